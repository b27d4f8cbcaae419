"""``opforge doctor`` inside a project made by ``opforge new``: does the
project's library build and load, and does every op of its namespace have a
kernel for each backend the build covers?

The project is found from the current folder upwards: a folder holding
``<package>/_build.py`` and ``<package>/_kernels.py`` (what ``opforge new``
writes). The package is imported in a subprocess, from the project folder,
so a build or a broken registration cannot take the doctor down; the
package's own ``check_kernels()`` (run by its ``__init__``) names each op and
backend without a kernel and the source list to fix.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_PROBE = """
import sys
try:
    import {pkg}
except ImportError as exc:
    print("BROKEN", str(exc).replace("\\n", " | "))
    sys.exit(0)
except Exception as exc:  # a BuildError: its first lines say what failed
    lines = str(exc).splitlines()
    print("BROKEN", type(exc).__name__ + ": " + " | ".join(lines[:3]))
    sys.exit(0)
import torch
names = torch._C._dispatch_get_all_op_names()
ops = sorted(n.split("::")[1] for n in names if n.startswith("{pkg}::") and n != "{pkg}::_build_info")
keys = "CPU, Meta, Autograd" + (", CUDA" if {pkg}.built_with_cuda() else "")
print("OK", len(ops), "op(s) (" + ", ".join(ops) + ") have " + keys + " kernels; kernels: " + {pkg}.kernels)
"""


def find_project(start: Path | None = None) -> tuple[Path, str] | None:
    """(project folder, package name) of the opforge-new project holding `start`, or None."""
    here = (start or Path.cwd()).resolve()
    for folder in [here, *here.parents]:
        for build in sorted(folder.glob("*/_build.py")):
            if (build.parent / "_kernels.py").is_file() and (folder / "pyproject.toml").is_file():
                return folder, build.parent.name
    return None


OK, FAIL = "OK", "FAIL"  # as opforge.doctor's statuses


def check_project(start: Path | None = None, timeout: float = 900) -> tuple[str, str, str, str] | None:
    """(name, status, detail, fix) of the project around `start` for doctor's report, or None outside one."""
    found = find_project(start)
    if found is None:
        return None
    folder, pkg = found
    name = f"project {pkg}"
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _PROBE.format(pkg=pkg)],
            cwd=folder,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return (name, FAIL, f"importing {pkg} took over {timeout:.0f} s", f"run `python -c 'import {pkg}'` in {folder}")
    out = proc.stdout.strip().splitlines()
    last = out[-1] if out else ""
    if proc.returncode != 0 or not last.startswith(("OK", "BROKEN")):
        err = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        return (
            name,
            FAIL,
            f"importing {pkg} failed: {err[-1] if err else '(no output)'}",
            f"run `python -c 'import {pkg}'` in {folder}",
        )
    if last.startswith("BROKEN"):
        return (
            name,
            FAIL,
            last.removeprefix("BROKEN "),
            f"fix {folder / pkg / '_build.py'}'s source lists or the TORCH_LIBRARY_IMPL blocks named above",
        )
    return (name, OK, last.removeprefix("OK "), "")
