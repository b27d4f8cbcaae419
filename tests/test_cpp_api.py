"""opforge from C++ without Python: the kernel library needs no Python symbol, and
tests/cpp/test_ops.cpp (built here against the torch wheel's libtorch) calls every op
of include/opforge/ops.h, forward and backward, and compares with ATen.

The program is one translation unit built with g++ at -O1 (8 s of CPU time here)
and cached under build/cpp-test/, keyed on its sources and the command line: a second
run does not recompile. It dlopens the library, so a rebuilt library needs no rebuilt
program. Run these tests alone with ``pytest -m cpp``.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import opforge
from opforge import _loader, extension

REPO = Path(__file__).resolve().parents[1]
SOURCE = REPO / "tests" / "cpp" / "test_ops.cpp"
OPS_H = Path(opforge.include_paths()[0]) / "opforge" / "ops.h"
CACHE = REPO / "build" / "cpp-test"
FAMILIES = ["add", "conv", "nms", "softmax"]

pytestmark = [
    pytest.mark.cpp,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ELF tools and /proc: Linux only"),
]


def _library() -> str:
    try:
        return _loader.library_path()
    except ImportError as exc:
        pytest.skip(f"no installed kernel library (JIT builds link libtorch_python): {exc}")


def _torch_lib() -> str:
    return extension.import_cpp_extension().library_paths()[0]


def build_commands(out: Path, library: str) -> tuple[list[str], list[str], list[str]]:
    """g++ lines for the program: compile, link (a program that dlopens the library
    named on its command line) and what linking against the library adds (as
    docs/cpp.md shows)."""
    cpp_extension = extension.import_cpp_extension()
    includes = [f"-I{p}" for p in cpp_extension.include_paths() + opforge.include_paths()]
    cxx, lib = shutil.which("c++") or "g++", _torch_lib()
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    compile_ = [cxx, "-std=c++20", "-O1", abi, *includes, "-c", str(SOURCE), "-o", str(out / "test_ops.o")]
    # libtorch_cpu and c10 are all the program itself calls; the library brings the rest.
    link = [cxx, str(out / "test_ops.o"), f"-L{lib}", f"-Wl,-rpath,{lib}", "-ltorch_cpu", "-lc10"]
    # No symbol of the library is referenced (ops.h calls through the dispatcher),
    # so the linker keeps it only with --no-as-needed.
    linked = [f"-Wl,--no-as-needed,{library},--as-needed", f"-Wl,-rpath,{Path(library).parent}"]
    return compile_, link, linked


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}{proc.stderr}"


@pytest.fixture(scope="module")
def programs() -> dict[str, Path]:
    """The program twice (dlopen-ing and linked), built once per change of its sources."""
    library = _library()
    key = hashlib.sha256()
    sources = sorted(SOURCE.parent.iterdir()) + [OPS_H]  # test_ops.cpp, its checks.h, ops.h
    for part in [p.read_bytes() for p in sources] + [repr(build_commands(Path("."), library)).encode()]:
        key.update(part)
    out = CACHE / key.hexdigest()[:16]
    names = {"dlopen": out / "test_ops", "linked": out / "test_ops_linked"}
    if not all(p.exists() for p in names.values()):
        for old in CACHE.glob("*"):  # older keys: nothing reuses them (builds in flight are left alone)
            if ".tmp" not in old.name:
                shutil.rmtree(old, ignore_errors=True)
        tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
        tmp.mkdir(parents=True)
        compile_, link, linked = build_commands(tmp, library)
        _run(compile_)
        _run([*link, "-o", str(tmp / "test_ops")])
        _run([*link, *linked, "-o", str(tmp / "test_ops_linked")])
        (tmp / "test_ops.o").unlink()
        try:
            os.replace(tmp, out)  # whole or not at all, should two runs build at once
        except OSError:  # the other run was first: its programs are the same
            shutil.rmtree(tmp, ignore_errors=True)
    return names


def run_program(binary: Path, *args: str) -> subprocess.CompletedProcess:
    # libtorch's folder on the loader's path: the library's own libtorch
    # dependencies (libtorch_cuda in a CUDA build) are found there.
    env = {
        **os.environ,
        "LD_LIBRARY_PATH": os.pathsep.join(filter(None, [_torch_lib(), os.environ.get("LD_LIBRARY_PATH")])),
    }
    return subprocess.run([str(binary), *args], capture_output=True, text=True, env=env, timeout=600)


def _report(proc: subprocess.CompletedProcess) -> str:
    failed = [ln for ln in proc.stdout.splitlines() if ln.startswith(("FAIL", "skip"))]
    return f"exit {proc.returncode}; failed checks:\n" + "\n".join(failed) + f"\n--- output\n{proc.stdout}{proc.stderr}"


def test_library_needs_no_python():
    library = _library()
    undefined = subprocess.run(["nm", "-D", "--undefined-only", library], capture_output=True, text=True, check=True)
    symbols = [ln.split()[-1] for ln in undefined.stdout.splitlines() if ln.strip()]
    python_symbols = [name for name in symbols if re.match(r"_?Py", name)]
    assert not python_symbols, f"{library} needs Python symbols: {python_symbols}"
    needed = subprocess.run(["readelf", "-d", library], capture_output=True, text=True, check=True).stdout
    assert "libpython" not in needed and "libtorch_python" not in needed, needed


def test_program_links_no_python(programs):
    for binary in programs.values():
        deps = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, check=True).stdout
        assert "libpython" not in deps and "libtorch_python" not in deps, deps


def test_program_knows_every_family(programs):
    proc = run_program(programs["dlopen"], "--list")
    assert proc.returncode == 0 and proc.stdout.split() == FAMILIES, proc.stdout + proc.stderr


@pytest.mark.parametrize("family", FAMILIES)
def test_cpp_program(programs, family):
    """Forward and backward of the family's ops from C++ match ATen; the process has no
    Python mapped (the program checks /proc/self/maps)."""
    proc = run_program(programs["dlopen"], _library(), family)
    assert proc.returncode == 0, _report(proc)
    assert "ok    no Python in the process" in proc.stdout and " 0 failed" in proc.stdout


def test_linked_program(programs):
    """The program linked against the library registers the ops at start-up, no dlopen."""
    needed = subprocess.run(["readelf", "-d", str(programs["linked"])], capture_output=True, text=True).stdout
    assert Path(_library()).name in needed, needed
    proc = run_program(programs["linked"], "add")
    assert proc.returncode == 0, _report(proc)


def test_unknown_family_is_a_usage_error(programs):
    proc = run_program(programs["dlopen"], _library(), "gelu")
    assert proc.returncode == 2 and "unknown family 'gelu'" in proc.stderr
