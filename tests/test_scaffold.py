"""`opforge new` without building anything: names are checked with reasons,
every kind renders a complete project in the user's names (no placeholder
name left), the CLI."""

import os
import re
import subprocess
import sys

import pytest
from scaffold_util import DEFAULT_NAMES, PROJECTS, project_env, run

from opforge import scaffold


@pytest.mark.parametrize(
    "bad, reason",
    [
        ("1abc", "must be a Python identifier"),
        ("my-op", "must be a Python identifier"),
        ("", "must be a Python identifier"),
        ("café", "ASCII"),
        ("class", "not a Python keyword"),
        ("tests", "the project's own tests/ folder"),
        ("build", "ignored by the project's .gitignore"),
        ("json", "standard library"),
        ("os", "standard library"),
        ("numpy", r"importable module \(.*numpy.*installing the project would overwrite it"),  # torch imports numpy
        ("torch", r"importable module \(.*torch"),
        ("opforge", r"importable module \(.*opforge"),
        ("aten", "one of torch's op namespaces"),
        ("prim", "one of torch's op namespaces"),
        ("load_library", "an attribute of torch.ops"),
        ("int", r"C\+\+ keyword"),
        ("at", r"ATen.s C\+\+ namespace"),
        ("std", r"standard library's C\+\+ namespace"),
    ],
)
def test_new_rejects_names_that_clash_and_says_why(bad, reason, tmp_path):
    with pytest.raises(scaffold.ScaffoldError, match=reason) as info:
        scaffold.create(bad, tmp_path / "p")
    assert "NAME" in str(info.value)
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize("good", ["torch_ops", "torchy", "opforge_extra", "MyOp", "bench", "cpu", "_fused"])
def test_new_accepts_names_that_clash_with_nothing(good):
    scaffold.validate_name(good)  # raises if refused


def test_new_refuses_numpy_for_the_true_reason():
    with pytest.raises(scaffold.ScaffoldError) as info:
        scaffold.validate_name("numpy")
    message = str(info.value)
    assert "would import the new package instead of it" in message
    assert "op namespace" not in message and "clashes with opforge" not in message


@pytest.mark.parametrize(
    "op, inputs, outputs, reason",
    [
        ("1op", None, None, r"--op must be an identifier .* starts with a letter, got '1op'"),
        ("_hidden", None, None, r"--op must be an identifier .* starts with a letter"),
        ("lambda", None, None, r"--op 'lambda' is a Python keyword"),
        ("match", None, None, r"--op 'match' is a Python keyword"),  # a soft keyword
        ("delete", None, None, r"--op 'delete' is a C\+\+ keyword"),
        ("tkn", None, None, r"--op 'tkn' is also the package's name"),
        ("nn", None, None, r"--op 'nn' would hide the package's nn module"),
        ("name", None, None, r"--op 'name' would hide an attribute of torch.ops.NAME"),
        ("gelu_backward", None, None, r"ends with _backward"),
        ("gelu", "x,x", None, r"--inputs names 'x' twice"),
        ("gelu", "x,,b", None, r"--inputs must be a comma-separated list"),
        ("gelu", "x,class", None, r"--inputs 'class' is a Python keyword"),
        ("gelu", "x,grad", None, r"--inputs 'grad' would clash with the backward op's incoming gradient"),
        ("gelu", "x,gelu", None, r"--inputs 'gelu' is also the op's name"),
        ("gelu", "x,tkn", None, r"--inputs 'tkn' is also the package's name"),
        ("gelu", "x,b", "x", r"--outputs 'x' is also an input's name"),
        ("gelu", "x,b", "y,z", r"--outputs: the elementwise kind makes ops with one output tensor, got 2"),
        ("gelu", "x,b", "new", r"--outputs 'new' is a C\+\+ keyword"),
    ],
)
def test_new_rejects_op_and_argument_names_and_says_why(op, inputs, outputs, reason, tmp_path):
    with pytest.raises(scaffold.ScaffoldError, match=reason):
        scaffold.create("tkn", tmp_path / "p", op=op, inputs=inputs, outputs=outputs)
    assert not (tmp_path / "p").exists()


def test_new_refuses_non_empty_dir(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(scaffold.ScaffoldError, match="exists and is not empty"):
        scaffold.create("tkfresh", tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]


def test_new_rejects_unknown_kind(tmp_path):
    with pytest.raises(scaffold.ScaffoldError, match="--kind must be one of elementwise, rowwise, blank"):
        scaffold.create("tkfresh", tmp_path / "p", kind="conv")


@pytest.mark.parametrize("kind", list(PROJECTS))
def test_new_renders_a_complete_project_in_the_users_names(kind, tmp_path):
    _, op, inputs, output = PROJECTS[kind]
    dest = scaffold.create("tkfiles", tmp_path / "proj", kind=kind, op=op, inputs=",".join(inputs), outputs=output)
    files = {p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()}
    expected = {
        "pyproject.toml",
        "setup.py",
        "README.md",
        "bench.py",
        ".gitignore",
        "__init__.py",
        "tests/conftest.py",
        "tests/bounds.py",
        f"tests/test_{op}.py",
        "tkfiles/__init__.py",
        "tkfiles/_build.py",
        "tkfiles/_kernels.py",
        "tkfiles/ops.py",
        "tkfiles/nn.py",
        "tkfiles/reference.py",
        "tkfiles/csrc/schemas.cpp",
        "tkfiles/csrc/module.cpp",
        "tkfiles/csrc/build_info.h",
        f"tkfiles/csrc/cpu/{op}.cpp",
        f"tkfiles/csrc/cuda/{op}_cuda.cu",
        f"tkfiles/csrc/{op}_checks.h",
        f"tkfiles/csrc/{op}_autograd.cpp",
        "tkfiles/csrc/tkfiles/ops.h",
    }
    if kind != "blank":
        expected |= {f"tkfiles/csrc/cpu/{op}_kernels.h", f"tkfiles/csrc/cpu/{op}_avx512.cpp"}
    assert expected <= files, sorted(expected - files)
    for path in dest.rglob("*"):
        if path.is_file():
            text = path.read_text()
            rel = path.relative_to(dest).as_posix()
            assert not re.search(r"\{\{\w+\}\}", text), rel
            assert "__name__/" not in text and "__op__" not in text and "__op__" not in rel, rel
            # No name of the templates' old fixed ops, in any file name or text.
            assert not re.search(DEFAULT_NAMES, rel), rel
            found = re.search(DEFAULT_NAMES, text)
            assert not found, (rel, found and text[max(0, found.start() - 80) : found.end() + 80])
    # The torch namespace is the project's own; the op and its inputs are the user's.
    schema = (dest / "tkfiles/csrc/schemas.cpp").read_text()
    assert "TORCH_LIBRARY(tkfiles, m)" in schema
    assert f'm.def("{op}(' + ", ".join(f"Tensor {i}" for i in inputs) + ') -> Tensor");' in schema
    assert f'"_{op}_backward(Tensor grad, ' in schema
    for key, file in (("CPU", f"cpu/{op}.cpp"), ("Meta", "schemas.cpp"), ("Autograd", f"{op}_autograd.cpp")):
        assert f"TORCH_LIBRARY_IMPL(tkfiles, {key}, m)" in (dest / "tkfiles/csrc" / file).read_text(), key
    assert "TORCH_LIBRARY_IMPL(tkfiles, CUDA, m)" in (dest / f"tkfiles/csrc/cuda/{op}_cuda.cu").read_text()
    wrapper = (dest / "tkfiles/ops.py").read_text()
    assert f"_{op} = torch.ops.tkfiles.{op}.default" in wrapper
    assert f"def {op}(" + ", ".join(f"{i}: torch.Tensor" for i in inputs) + ") -> torch.Tensor:" in wrapper
    for python_side in ("register_fake", "register_autograd", "raise ", "_dispatch"):
        assert python_side not in wrapper, python_side
    assert f"class {scaffold.scaffold_context.camel(op)}(torch.nn.Module)" in (dest / "tkfiles/nn.py").read_text()
    # No hidden names: CUDA tests are decided from torch and the library's own build info.
    conftest = (dest / "tests/conftest.py").read_text()
    assert "torch.cuda.is_available()" in conftest and "tkfiles.built_with_cuda()" in conftest
    assert op not in conftest and "_dispatch_has_kernel" not in conftest
    # Every source in the one source list exists.
    build = (dest / "tkfiles/_build.py").read_text()
    listed = re.findall(r'"(csrc/[^"]+)"', build)
    assert listed and all((dest / "tkfiles" / src).is_file() for src in listed), listed
    # ... and every source file is listed, once; the longest compile (autograd) starts first.
    csrc = dest / "tkfiles/csrc"
    sources = {f"csrc/{p.relative_to(csrc).as_posix()}" for p in csrc.rglob("*") if p.suffix in (".cpp", ".cu")}
    assert sorted(listed) == sorted(sources), (listed, sources)
    assert listed[0] == f"csrc/{op}_autograd.cpp", listed
    assert not (dest / f"tkfiles/csrc/{op}_meta.cpp").exists()  # the Meta kernels are in schemas.cpp


def test_new_defaults_are_todays_ops(tmp_path):
    for kind, op, inputs in (("elementwise", "add_relu", "a, b"), ("rowwise", "softmax", "x"), ("blank", "my_op", "x")):
        dest = scaffold.create("tkdef", tmp_path / kind, kind=kind)
        assert f"def {op}(" in (dest / "tkdef/ops.py").read_text()
        assert f"return _{op}({inputs})" in (dest / "tkdef/ops.py").read_text()


def test_project_folder_cannot_be_imported_as_the_package(tmp_path):
    """A script next to the project folder (named like the package) gets a clear ImportError,
    not an empty namespace package."""
    dest = scaffold.create("tktrap", tmp_path / "tktrap")
    proc = subprocess.run(
        [sys.executable, "-c", "import tktrap"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1
    assert f"imported the project folder {dest} instead of the tktrap package inside it" in proc.stderr
    assert "cd into it" in proc.stderr


def test_new_cli(tmp_path):
    env = project_env(tmp_path / "ext")
    new = [sys.executable, "-m", "opforge", "new"]
    proc = run(
        new + ["tkcli", "--dir", str(tmp_path / "p"), "--kind", "rowwise", "--op", "sm", "--inputs", "a,b"],
        tmp_path,
        env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "created" in proc.stdout and f"{sys.executable} -m pytest -q tests" in proc.stdout
    assert "def sm(a: torch.Tensor, b: torch.Tensor)" in (tmp_path / "p" / "tkcli" / "ops.py").read_text()
    proc = run(new + ["tkcli", "--dir", str(tmp_path / "p")], tmp_path, env, timeout=120)
    assert proc.returncode == 2 and "exists and is not empty" in proc.stderr
    proc = run(new + ["numpy", "--dir", str(tmp_path / "q")], tmp_path, env, timeout=120)
    assert proc.returncode == 2 and "opforge new: NAME 'numpy' is already an importable module" in proc.stderr
    proc = run(new + ["tkcli2", "--dir", str(tmp_path / "r"), "--inputs", "x,x"], tmp_path, env, timeout=120)
    assert proc.returncode == 2 and "opforge new: --inputs names 'x' twice" in proc.stderr


def test_new_next_steps_name_a_python_that_has_torch_and_opforge(tmp_path):
    dest = scaffold.create("tksteps", tmp_path / "p")
    text = scaffold.next_steps(dest, "tksteps")
    commands = [ln.split("#")[0].strip() for ln in text.splitlines() if ln.startswith("  ")]
    assert commands[0] == f"cd {dest}"
    assert len(commands) == 4 and all(sys.executable in c for c in commands[1:]), text
    # Each command starts with the interpreter (and PYTHONPATH, if this Python finds opforge only
    # through it); run it from a fresh shell's environment, in the project folder.
    runner = commands[1].split(" -m pytest")[0]
    fresh = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/")}
    proc = subprocess.run(
        f"{runner} -c 'import torch, pytest, opforge.extension; print(torch.__version__)'",
        shell=True,
        cwd=dest,
        env=fresh,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == __import__("torch").__version__


def test_listed_sources_that_do_not_exist_are_a_build_error(tmp_path):
    from opforge import extension

    (tmp_path / "csrc").mkdir()
    (tmp_path / "csrc" / "here.cpp").write_text("")
    src = extension.SourceSet(
        name="tk_C",
        root=tmp_path,
        cpu_sources=["csrc/here.cpp", "csrc/gone.cpp"],
        cuda_sources=["csrc/gone_cuda.cu"],
        defined_in="/p/tk/_build.py",
    )
    # CUDA sources too, on a CPU-only build: the mistake shows where it is made.
    with pytest.raises(extension.BuildError) as info:
        src.sources(with_cuda=False)
    message = str(info.value)
    assert "tk_C: 2 listed source(s) do not exist" in message
    assert f"csrc/gone.cpp (in cpu_sources of /p/tk/_build.py): no file {tmp_path / 'csrc/gone.cpp'}" in message
    assert "csrc/gone_cuda.cu (in cuda_sources of /p/tk/_build.py)" in message
    assert "here.cpp" not in message
