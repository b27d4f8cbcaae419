"""Runs test code in a fresh process with torch's CPU capability capped (ATEN_CPU_CAPABILITY),
so that opforge picks its loops for that instruction set, and checks which it picked."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

ORDER = ["default", "avx2", "avx512"]


def native() -> str:
    """The best instruction set torch finds on this CPU (this process runs uncapped)."""
    return torch.backends.cpu.get_cpu_capability().lower()


def run_capped(capability: str, code: str) -> None:
    """Runs `code` with the capability capped at `capability`: the code must print "ok" and
    opforge must have picked that ISA's loops. Skipped where this CPU cannot run them."""
    best = native()
    if best in ORDER and ORDER.index(capability) > ORDER.index(best):
        pytest.skip(f"this CPU runs at most {best.upper()}: the {capability.upper()} loops cannot run here")
    picked = "\nfrom opforge import _loader\nprint('isa', _loader.build_info()['cpu_isa'])\n"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    proc = subprocess.run([sys.executable, "-c", code + picked], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.split()
    assert lines[0] == "ok", proc.stdout
    assert lines[-2:] == ["isa", capability.upper()], proc.stdout
