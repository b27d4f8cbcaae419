"""opforge from C++ without Python: the kernel library needs no Python symbol, and
tests/cpp/test_ops.cpp (built here against the torch wheel's libtorch) calls every op
of include/opforge/ops.h, forward and backward, and compares with ATen.

The program is one translation unit built with g++ at -O1 (8 s of CPU time here)
and cached under build/cpp-test/, keyed on its sources and the command line: a second
run does not recompile. It dlopens the library, so a rebuilt library needs no rebuilt
program. Run these tests alone with ``pytest -m cpp``.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import opforge
from opforge import _loader, native_build

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


@pytest.fixture(scope="module")
def programs() -> dict[str, Path]:
    """The program twice (dlopen-ing and linked), built once per change of its sources."""
    library = _library()
    libs = ("torch_cpu", "c10")  # all the program itself calls; the library brings the rest
    return native_build.build_programs(
        SOURCE,
        CACHE,
        {"test_ops": (libs, None), "test_ops_linked": (libs, library)},
        extra_inputs=[p for p in sorted(SOURCE.parent.iterdir()) if p != SOURCE] + [OPS_H],
    )


def run_program(binary: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(binary), *args], capture_output=True, text=True, env=native_build.run_env(), timeout=600)


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


def test_library_ships_without_host_debug_information():
    """The deployed artifact stays small: no DWARF sections (they were 94% of its size)."""
    library = _library()
    sections = subprocess.run(["readelf", "-S", "-W", library], capture_output=True, text=True, check=True).stdout
    assert ".debug_info" not in sections, sections


def test_program_links_no_python(programs):
    for binary in programs.values():
        deps = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, check=True).stdout
        assert "libpython" not in deps and "libtorch_python" not in deps, deps


def test_program_knows_every_family(programs):
    proc = run_program(programs["test_ops"], "--list")
    assert proc.returncode == 0 and proc.stdout.split() == FAMILIES, proc.stdout + proc.stderr


@pytest.mark.parametrize("family", FAMILIES)
def test_cpp_program(programs, family):
    """Forward and backward of the family's ops from C++ match ATen; the process has no
    Python mapped (the program checks /proc/self/maps)."""
    proc = run_program(programs["test_ops"], _library(), family)
    assert proc.returncode == 0, _report(proc)
    assert "ok    no Python in the process" in proc.stdout and " 0 failed" in proc.stdout


def test_linked_program(programs):
    """The program linked against the library registers the ops at start-up, no dlopen."""
    needed = subprocess.run(["readelf", "-d", str(programs["test_ops_linked"])], capture_output=True, text=True).stdout
    assert Path(_library()).name in needed, needed
    proc = run_program(programs["test_ops_linked"], "add")
    assert proc.returncode == 0, _report(proc)


def test_unknown_family_is_a_usage_error(programs):
    proc = run_program(programs["test_ops"], _library(), "gelu")
    assert proc.returncode == 2 and "unknown family 'gelu'" in proc.stderr
