"""Projects made by `opforge new`, built and run: each kind, with a
non-default op name and three inputs, passes its own tests and runs its
benchmark on the first try (CPU, JIT), its CUDA source compiles with nvcc,
`opforge doctor` vouches for it; and a project broken as users break them
(a listed source renamed, a kernel file left out of _build.py, a kernel not
registered) says what to fix.

Each project is built once per module (the builds are what costs time)."""

import re
import shutil
import sys
from pathlib import Path

import pytest
from scaffold_util import PROJECTS, project_env, run

from opforge import extension, scaffold

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ext_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("scaffold_extensions")


_built: dict = {}


def _project(kind, tmp_path_factory, ext_dir):
    """(name, op, dest, env, result of its own test run), made and tested once per kind."""
    if kind not in _built:
        name, op, inputs, output = PROJECTS[kind]
        dest = scaffold.create(
            name, tmp_path_factory.mktemp(kind) / name, kind=kind, op=op, inputs=",".join(inputs), outputs=output
        )
        env = project_env(ext_dir)
        proc = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"], dest, env)
        _built[kind] = (name, op, dest, env, proc)
    return _built[kind]


@pytest.fixture(scope="module", params=list(PROJECTS))
def generated(request, tmp_path_factory, ext_dir):
    return (request.param, *_project(request.param, tmp_path_factory, ext_dir))


def test_generated_project_passes_its_own_tests(generated):
    kind, name, op, dest, env, proc = generated
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-4000:]
    passed = int(re.search(r"(\d+) passed", out).group(1))
    assert not re.search(r"\d+ (failed|errors?)\b", out), out[-4000:]
    if kind == "blank":
        # Honest: registration, checks, Meta and autograd pass; what needs values is an expected
        # failure that names the missing kernel.
        assert passed >= 5 and re.search(r"(\d+) xfailed", out), out[-2000:]
        assert "kernels or reference are not written yet" in out
    else:
        assert passed >= 50 and "xfail" not in out, out[-2000:]
    # It JIT-built its own library, CPU kernels only (no GPU visible).
    assert list(Path(env["TORCH_EXTENSIONS_DIR"]).glob(f"{name}_C/{name}_C*.so"))


def test_generated_project_bench(generated):
    kind, name, op, dest, env, proc = generated
    assert proc.returncode == 0
    bench = run([sys.executable, "bench.py", "--quick", "--device", "cpu"], dest, env)
    if kind == "blank":
        assert bench.returncode == 1 and "nothing to time yet" in bench.stderr and "write the kernel in" in bench.stderr
        return
    assert bench.returncode == 0, bench.stderr[-4000:]
    out = bench.stdout
    assert f"{name}.{op} on cpu (kernels: jit:" in out
    assert "ours ms" in out and "eager ms" in out and "compile ms" in out
    rows = [ln for ln in out.splitlines() if ln.startswith(("float32", "bfloat16"))]
    assert len(rows) == 4 and not any("WRONG" in r for r in rows), out


def test_generated_project_loads_without_opforge_and_says_what_it_has(generated):
    kind, name, op, dest, env, proc = generated
    code = (
        f"import sys, torch, {name}\n"
        f"print({name}.kernels, {name}.built_with_cuda(), 'opforge' in sys.modules)\n"
        f"print(torch._C._dispatch_has_kernel_for_dispatch_key('{name}::{op}', 'CPU'))\n"
    )
    proc = run([sys.executable, "-c", code], dest, env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    first, second = proc.stdout.splitlines()
    kernels, cuda, opforge_loaded = first.split()
    # Building and loading the project never imports opforge itself (nor its kernels).
    assert kernels.startswith("jit:") and cuda == "False" and opforge_loaded == "False"
    assert second == "True"


def test_doctor_inside_the_project(generated):
    kind, name, op, dest, env, proc = generated
    doc = run([sys.executable, "-m", "opforge", "doctor", "--no-kernels"], dest / name / "csrc", env)
    line = next(ln for ln in doc.stdout.splitlines() if f"project {name}" in ln)
    assert line.startswith("[ OK ]") and f"_{op}_backward, {op}) have CPU, Meta, Autograd kernels" in line, line


def _nvcc_ptx_command(src: extension.SourceSet, cu: Path) -> list[str]:
    """nvcc as the CUDA build runs it (flags, defines, includes), for one sm_90 PTX: the device code
    compiled and the host code parsed by nvcc's front end, without the host compiler's pass."""
    cpp_extension = extension.import_cpp_extension()
    _, nvcc_flags = src.flags(with_cuda=True, for_wheel=False)
    includes = src.all_include_dirs(with_cuda=True) + cpp_extension.include_paths(device_type="cuda")
    return (
        [extension.find_nvcc(), "--ptx", "-arch=compute_90", "-std=c++20", "-o", "/dev/null", str(cu)]
        + [f for f in cpp_extension.COMMON_NVCC_FLAGS if f.startswith(("-D", "--expt"))]
        + [f for f in nvcc_flags if f != "-lineinfo"]
        + [f"-I{d}" for d in includes]
    )


@pytest.mark.skipif(extension.find_nvcc() is None, reason="needs nvcc (the CUDA toolkit)")
def test_generated_cuda_source_compiles(generated):
    kind, name, op, dest, env, proc = generated
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"_{name}_build_for_nvcc", dest / name / "_build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    (cu,) = build.SOURCES.cuda_sources
    nvcc = run(_nvcc_ptx_command(build.SOURCES, dest / name / cu), dest, env, timeout=600)
    assert nvcc.returncode == 0, nvcc.stdout[-3000:] + nvcc.stderr[-3000:]


# --------------------------------------------------------------------------- broken projects


def _import(name, dest, env):
    return run([sys.executable, "-c", f"import {name}"], dest, env, timeout=900)


def test_broken_projects_say_what_to_fix(tmp_path_factory, ext_dir):
    """The elementwise project, broken and mended in place, one mistake at a time."""
    name, op, dest, env, proc = _project("elementwise", tmp_path_factory, ext_dir)
    assert proc.returncode == 0
    pkg = dest / name
    build_py = pkg / "_build.py"
    original_build = build_py.read_text()
    meta = pkg / "csrc" / "schemas.cpp"  # the Meta kernels' registration
    original_meta = meta.read_text()
    try:
        # 1. A listed source renamed: BuildError naming the file and its list, before any compile.
        shutil.move(pkg / f"csrc/cpu/{op}_avx2.cpp", pkg / f"csrc/cpu/{op}_avx2_new.cpp")
        broken = _import(name, dest, env)
        assert broken.returncode == 1
        assert "BuildError" in broken.stderr and "FileNotFoundError" not in broken.stderr
        assert f"csrc/cpu/{op}_avx2.cpp (in cpu_sources of {build_py})" in broken.stderr, broken.stderr[-2000:]
        shutil.move(pkg / f"csrc/cpu/{op}_avx2_new.cpp", pkg / f"csrc/cpu/{op}_avx2.cpp")

        # 2. A kernel file left out of the source list: it builds, and the import names the op,
        # the backend, the list to fix and the unlisted file that registers that backend.
        build_py.write_text(original_build.replace(f'"csrc/cpu/{op}.cpp",\n', ""))
        broken = _import(name, dest, env)
        assert broken.returncode == 1
        message = broken.stderr
        assert f"{name}'s kernels are incomplete" in message, message[-2000:]
        assert f"{name}::{op} has no CPU kernel" in message and f"{name}::_{op}_backward has no CPU kernel" in message
        assert f"TORCH_LIBRARY_IMPL({name}, CPU, m)" in message and f"listed in cpu_sources of {build_py}" in message
        assert f"not listed there but registering CPU kernels: csrc/cpu/{op}.cpp" in message
        assert "Meta kernel" not in message and "Autograd kernel" not in message
        # opforge doctor, run inside the project, says the same.
        doc = run([sys.executable, "-m", "opforge", "doctor", "--no-kernels"], dest, env)
        line = next(ln for ln in doc.stdout.splitlines() if f"project {name}" in ln)
        assert line.startswith("[FAIL]") and f"{name}::{op} has no CPU kernel" in line, doc.stdout[-2000:]
        assert doc.returncode == 1
        build_py.write_text(original_build)

        # 3. A kernel not registered (its m.impl line deleted): the op and the key are named.
        meta.write_text(original_meta.replace(f'  m.impl("_{op}_backward", &{op}_backward_meta);\n', ""))
        broken = _import(name, dest, env)
        assert broken.returncode == 1
        assert f"{name}::_{op}_backward has no Meta kernel" in broken.stderr, broken.stderr[-2000:]
        assert f"{name}::{op} has no" not in broken.stderr
    finally:
        build_py.write_text(original_build)
        meta.write_text(original_meta)
        for stray in pkg.glob(f"csrc/cpu/{op}_avx2_new.cpp"):
            shutil.move(stray, pkg / f"csrc/cpu/{op}_avx2.cpp")
    mended = _import(name, dest, env)
    assert mended.returncode == 0, mended.stderr[-2000:]
