"""Runs test code in a fresh process with torch's CPU capability capped (ATEN_CPU_CAPABILITY),
so that opforge picks its loops for that instruction set, and reports which it picked."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

ORDER = ["default", "avx2", "avx512"]


def native() -> str:
    """The best instruction set opforge can pick on this CPU, as opforge names it (this process
    runs uncapped, so torch's own detection tells)."""
    best = torch.backends.cpu.get_cpu_capability().lower()
    return best.upper() if best in ORDER else "DEFAULT"


def picked_isa(capability: str, code: str) -> str:
    """Runs `code`, which must print "ok", with the capability capped at `capability`; returns
    the ISA opforge picked there."""
    picked = "\nfrom opforge import _loader\nprint('isa', _loader.build_info()['cpu_isa'])\n"
    # The code's random draws follow the calling test's seed (set by conftest), as in-process ones do.
    seeded = "import os, torch\ntorch.manual_seed(int(os.environ.get('OPFORGE_TEST_CASE_SEED', '0')))\n"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    proc = subprocess.run(
        [sys.executable, "-c", seeded + code + picked], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.split()
    assert lines[0] == "ok" and lines[-2] == "isa", proc.stdout
    return lines[-1]


def run_capped(capability: str, code: str) -> None:
    """Runs `code` (see picked_isa) on `capability`'s loops: opforge must have picked them.
    Skipped where this CPU cannot run them."""
    best = native().lower()
    if ORDER.index(capability) > ORDER.index(best):
        pytest.skip(f"this CPU runs at most {best.upper()}: the {capability.upper()} loops cannot run here")
    assert picked_isa(capability, code) == capability.upper()
