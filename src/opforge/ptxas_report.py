"""Registers and spills of CUDA kernels, as ptxas reports them (``-Xptxas -v``).

A kernel that spills keeps values in local memory: memory traffic a
memory-bound kernel was written to avoid, and latency in its inner loop.
``opforge ptxas`` makes the check one command:

    opforge ptxas                          # every CUDA source of opforge
    opforge ptxas my_op/csrc/cuda/op.cu    # any file, with opforge's flags and include paths
    opforge ptxas --log build.log          # a build log made with OPFORGE_PTXAS_VERBOSE=1

Files are compiled for one architecture (``--arch``, default 90), device
code only (``--cubin``), with the flags of opforge's own build plus the
file's folder and its parent on the include path. ``OPFORGE_PTXAS_VERBOSE=1``
adds ``-Xptxas -v`` to any build that uses :mod:`opforge.extension`
(opforge's setup.py and JIT build, and projects made by ``opforge new``), so
``--log`` can read a whole build's output. Prints, per file, the kernels and
their most registers, and every kernel that spills; exit status 1 when any
kernel spills, 2 when a file does not compile.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\w+)'")
_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")


@dataclasses.dataclass
class Kernel:
    name: str  # mangled
    arch: str
    registers: int = 0
    stack: int = 0
    spill_stores: int = 0
    spill_loads: int = 0

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0


def parse(text: str) -> list[Kernel]:
    """Every kernel ptxas reported in ``text`` (its -v output), in order."""
    kernels: list[Kernel] = []
    for line in text.splitlines():
        m = _ENTRY.search(line)
        if m:
            kernels.append(Kernel(m.group(1), m.group(2)))
            continue
        if not kernels:
            continue
        m = _SPILLS.search(line)
        if m:
            k = kernels[-1]
            k.stack, k.spill_stores, k.spill_loads = (int(g) for g in m.groups())
            continue
        m = _REGS.search(line)
        if m:
            kernels[-1].registers = int(m.group(1))
    return kernels


def demangle(names: list[str]) -> list[str]:
    """Readable names through c++filt when it is installed (else as given):
    the function and its template arguments, without its parameter list."""
    tool = shutil.which("c++filt")
    if not tool or not names:
        return list(names)
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    if len(out) != len(names):
        return list(names)
    short = []
    for name in out:
        name = name.replace("(anonymous namespace)::", "").removeprefix("void ")
        short.append(name.split("(", 1)[0])
    return short


def compile_command(cu: Path, arch: str, out: Path, extra_includes: list[str] = ()) -> list[str]:
    """nvcc compiling ``cu``'s device code for sm_<arch> with opforge's flags and -Xptxas -v."""
    import torch.utils.cpp_extension as cpp

    from . import extension
    from ._build import SOURCES

    nvcc = extension.find_nvcc()
    if nvcc is None:
        raise RuntimeError("nvcc was not found (set CUDA_HOME or put nvcc on PATH)")
    _, flags = SOURCES.flags(with_cuda=True, for_wheel=False)
    includes = [str(cu.parent), str(cu.parent.parent), *extra_includes]
    includes += SOURCES.all_include_dirs(with_cuda=True) + cpp.include_paths(device_type="cuda")
    return [
        nvcc,
        "--cubin",
        f"-arch=sm_{arch}",
        "-std=c++20",
        "-Xptxas",
        "-v",
        *cpp.COMMON_NVCC_FLAGS,
        *flags,
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        "-DTORCH_EXTENSION_NAME=_C",
        *(f"-I{d}" for d in includes),
        "-o",
        str(out),
        str(cu),
    ]


def compile_report(cu: Path, arch: str, extra_includes: list[str] = ()) -> str:
    """ptxas's -v output for one file (raises RuntimeError with nvcc's errors if it does not compile)."""
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run(
            compile_command(cu, arch, Path(tmp) / "out.cubin", extra_includes), capture_output=True, text=True
        )
    if proc.returncode != 0:
        raise RuntimeError(f"{cu} does not compile:\n{proc.stderr[-4000:]}")
    return proc.stdout + proc.stderr


def summary(label: str, kernels: list[Kernel]) -> tuple[list[str], int]:
    """Lines describing ``kernels`` and how many of them spill."""
    spilling = [k for k in kernels if k.spills]
    most = max((k.registers for k in kernels), default=0)
    lines = [f"{label}: {len(kernels)} kernels, up to {most} registers, {len(spilling)} spilling"]
    for k, name in zip(spilling, demangle([k.name for k in spilling])):
        lines.append(
            f"  {k.arch} {k.registers:3d} regs, {k.spill_stores} B spill stores, {k.spill_loads} B spill loads: {name}"
        )
    return lines, len(spilling)


def main(files: list[str], log: str | None = None, arch: str = "90", includes: list[str] = ()) -> int:
    if log is not None:
        reports = [(log, Path(log).read_text(errors="replace"))]
    else:
        if not files:
            from ._build import SOURCES

            files = [str(Path(SOURCES.root) / f) for f in SOURCES.cuda_sources]
        reports = []
        for f in files:
            try:
                reports.append((f, compile_report(Path(f), arch, list(includes))))
            except RuntimeError as exc:
                print(f"opforge ptxas: {exc}", file=sys.stderr)
                return 2
    total = 0
    for label, text in reports:
        lines, n = summary(label, parse(text))
        print("\n".join(lines))
        total += n
    return 1 if total else 0
