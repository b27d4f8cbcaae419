"""The build paths: JIT build and cache, CPU-only build, load errors, CLI."""

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import opforge
from opforge import _loader, extension, jit

REPO = Path(__file__).resolve().parents[1]
PKG = Path(opforge.__file__).resolve().parent


def run_python(code, env=None, timeout=900, cwd=None):
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        cwd=cwd,
    )


@pytest.fixture(scope="module")
def jit_cache(tmp_path_factory):
    """A fresh extensions folder holding one CPU-only JIT build of opforge."""
    cache = tmp_path_factory.mktemp("torch_extensions")
    env = {"OPFORGE_JIT": "1", "OPFORGE_CUDA": "0", "TORCH_EXTENSIONS_DIR": str(cache)}
    proc = run_python(
        """
        import torch, opforge
        from opforge import _loader
        a, b = torch.randn(1000), torch.randn(1000)
        assert torch.equal(opforge.add_relu(a, b), torch.relu(a + b))
        print("SOURCE", _loader.source)
        print("INFO", _loader.build_info())
        """,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return cache, env, proc.stdout + proc.stderr


@pytest.mark.slow
def test_jit_build_cpu_only(jit_cache):
    cache, _, out = jit_cache
    assert "SOURCE jit:" in out and str(cache) in out
    assert "'cuda': 'none'" in out  # the CPU-only build says so
    assert "No CUDA runtime is found" not in out  # torch's cpp_extension was imported through opforge's guard
    assert list(cache.rglob("opforge_C*.so"))


@pytest.mark.slow
def test_jit_reuses_cache_and_clears_stale_lock(jit_cache):
    cache, env, _ = jit_cache
    build_dir = next(p.parent for p in cache.rglob("opforge_C*.so"))
    libs_before = {p: p.stat().st_mtime_ns for p in build_dir.glob("*.so")}
    objects_before = {p: p.stat().st_mtime_ns for p in build_dir.glob("*.o")}
    # A lock file left by a build that was killed half-way.
    (build_dir / "lock").write_text("")
    proc = run_python("import opforge; print(opforge.add(*__import__('torch').ones(2, 3)))", env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # Nothing changed, so nothing was recompiled.
    assert {p: p.stat().st_mtime_ns for p in build_dir.glob("*.o")} == objects_before
    assert {p: p.stat().st_mtime_ns for p in build_dir.glob("*.so")} == libs_before


@pytest.mark.slow
def test_cache_clear_cli(jit_cache, tmp_path):
    cache, env, _ = jit_cache
    copy = tmp_path / "ext"
    shutil.copytree(cache, copy)
    env = {**env, "TORCH_EXTENSIONS_DIR": str(copy)}
    proc = run_python("from opforge.cli import main; main(['cache', 'path'])", env=env)
    assert proc.returncode == 0 and str(copy) in proc.stdout, proc.stderr
    proc = run_python("from opforge.cli import main; main(['cache', 'clear'])", env=env)
    assert proc.returncode == 0 and "removed" in proc.stdout, proc.stderr
    assert not list(copy.rglob("opforge_C*.so"))


def test_jit_build_error_shows_compiler_error(tmp_path):
    src = tmp_path / "csrc"
    src.mkdir()
    (src / "broken.cpp").write_text("int main() { return undefined_name; }\n")
    sources = extension.SourceSet(name="opforge_broken_test", root=tmp_path, cpu_sources=["csrc/broken.cpp"])
    env_before = os.environ.get("TORCH_EXTENSIONS_DIR")
    os.environ["TORCH_EXTENSIONS_DIR"] = str(tmp_path / "ext")
    try:
        with pytest.raises(extension.BuildError) as info:
            extension.jit_load(sources, with_cuda=False)
    finally:
        if env_before is None:
            os.environ.pop("TORCH_EXTENSIONS_DIR")
        else:
            os.environ["TORCH_EXTENSIONS_DIR"] = env_before
    message = str(info.value)
    assert "first error:" in message and "broken.cpp:1" in message and "undefined_name" in message


@pytest.fixture(scope="module")
def no_kernels(tmp_path_factory):
    """A copy of the package without its compiled module, imported first on the path."""
    root = tmp_path_factory.mktemp("no_kernels")
    shutil.copytree(PKG, root / "opforge", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    return root, {"PYTHONPATH": str(root), "OPFORGE_JIT": "0"}


@pytest.mark.parametrize(
    "code",
    [
        "import torch, opforge",  # torch first: import opforge loads the kernels at once
        "import opforge; opforge.add_relu",  # otherwise the first use of an op does
        "from opforge import add_relu",
        "from opforge import nn",
        "import opforge.nn",
        "import opforge; opforge.ops",
        "from opforge.ops.softmax import softmax",
    ],
)
def test_missing_compiled_module_is_an_import_error(no_kernels, code):
    root, env = no_kernels
    proc = run_python(code, env=env, cwd=root)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "ImportError: opforge's compiled kernels (opforge._C) could not be loaded: no _C.abi3.so in"
    ), proc.stderr
    assert "pip install --no-build-isolation -e ." in last and "OPFORGE_JIT=1" in last


@pytest.mark.parametrize(
    "argv, expect",
    [
        (["cache", "path"], "opforge_C"),
        (["doctor", "--no-kernels"], "[ OK ] compiler"),
        (["new", "tknok", "--dir", "proj"], "created"),
        (["ptxas", "--log", "empty.log"], "empty.log: 0 kernels"),
    ],
)
def test_tooling_commands_run_without_kernels(no_kernels, tmp_path, argv, expect):
    root, env = no_kernels
    (tmp_path / "empty.log").write_text("")
    proc = subprocess.run(
        [sys.executable, "-m", "opforge", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, **env},
    )
    assert "ImportError" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert expect in proc.stdout, proc.stdout + proc.stderr
    assert (
        str(root / "opforge")
        in subprocess.run(  # the copy without kernels is the one that ran
            [sys.executable, "-c", "import opforge; print(opforge.__file__)"],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            env={**os.environ, **env},
        ).stdout
    )


def test_import_opforge_alone_imports_no_torch_and_binds_plain_attributes():
    proc = run_python(
        """
        import sys, opforge
        loaded = lambda: getattr(sys.modules.get("opforge._loader"), "source", None) is not None
        print("torch" in sys.modules, loaded())
        import torch
        y = opforge.add_relu(torch.ones(3), -2 * torch.ones(3))  # the first use loads the kernels
        print(loaded(), "add_relu" in vars(opforge), y.tolist())
        print(torch.ops.opforge.add_relu.default(torch.ones(2), torch.ones(2)).tolist(), opforge.nn.AddReLU.__name__)
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:3] == ["False False", "True True [0.0, 0.0, 0.0]", "[2.0, 2.0] AddReLU"]


def test_import_after_torch_registers_the_ops_at_once():
    proc = run_python("import torch, opforge\nprint(torch.ops.opforge.softmax.default(torch.zeros(1, 2)).tolist())")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[[0.5, 0.5]]"


def test_kernels_for_another_torch_are_refused():
    _loader.check_torch_version("2.14", "2.14.1+cu130")  # same release: fine
    with pytest.raises(ImportError, match=r"built for torch 2.9 but torch 2.14 is installed. Rebuild them"):
        _loader.check_torch_version("2.9", "2.14.1+cu130")


def test_build_info_matches_this_torch():
    info = _loader.build_info()
    assert info["torch"] == ".".join(torch.__version__.split(".")[:2])
    can_build_cuda = torch.version.cuda and extension.find_nvcc() and os.environ.get("OPFORGE_CUDA") != "0"
    forced = os.environ.get("OPFORGE_CUDA") == "1"  # CI sets it: the CUDA kernels must have been built
    if _loader.source == "installed" and (forced or (can_build_cuda and torch.cuda.is_available())):
        # With a GPU visible every build compiles CUDA kernels when it can (pip's
        # setup.py always does; the in-place build of `make build` only with a GPU).
        assert info["cuda"] != "none" and "archs" in info


def test_cuda_decision_env(monkeypatch):
    monkeypatch.setenv("OPFORGE_CUDA", "0")
    assert extension.decide_cuda().enabled is False
    monkeypatch.setenv("OPFORGE_CUDA", "maybe")
    with pytest.raises(ValueError, match="OPFORGE_CUDA must be 0 or 1"):
        extension.decide_cuda()


def test_arch_list_default_and_override(monkeypatch):
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    assert extension.cuda_arch_list() == "8.0;8.6;8.9;9.0+PTX"
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    assert extension.cuda_arch_list() == "9.0"


def test_info_cli():
    proc = run_python("from opforge.cli import main; main(['info'])")
    assert proc.returncode == 0, proc.stderr
    for key in ("opforge", "torch", "CUDA kernels", "ops", "add_relu", "JIT cache", "GPU"):
        assert key in proc.stdout


# --------------------------------------------------------------------------- cache path without torch


CACHE_PATHS = """
import json, os, sys, time
start = time.perf_counter()
from opforge import _cpp_extension, jit
ours = str(jit.cache_dir())
version = _cpp_extension.torch_version()
took = time.perf_counter() - start
imported = "torch" in sys.modules
import torch
from torch.utils import cpp_extension
print(json.dumps({"ours": ours, "torch": cpp_extension._get_build_directory("opforge_C", verbose=False),
                  "version": version, "real": [torch.__version__, torch.version.cuda, torch.version.hip],
                  "imported_torch": imported, "took": took}))
"""


@pytest.mark.parametrize("extensions_dir", [None, "ext"])
def test_cache_dir_is_torchs_answer_without_importing_torch(tmp_path, extensions_dir):
    import json

    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")  # torch creates the folder it names: keep it here
    if extensions_dir:
        env["TORCH_EXTENSIONS_DIR"] = str(tmp_path / extensions_dir)
    proc = subprocess.run([sys.executable, "-c", CACHE_PATHS], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["ours"] == got["torch"]
    assert got["ours"].startswith(str(tmp_path / (extensions_dir or "xdg")))
    assert got["imported_torch"] is False
    assert [got["version"][k] for k in ("__version__", "cuda", "hip")] == got["real"]


def test_cache_path_command_is_quick_and_imports_no_torch():
    code = (
        "import sys, time; t = time.perf_counter(); from opforge.cli import main; main(['cache', 'path']); "
        "print(time.perf_counter() - t, 'torch' in sys.modules)"
    )
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr
    path, took, imported = proc.stdout.split()
    assert path == str(jit.cache_dir()) and imported == "False"
    assert float(took) < 1.0  # the no-torch path takes milliseconds; importing torch alone takes seconds here
