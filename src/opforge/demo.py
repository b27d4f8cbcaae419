"""``opforge demo``: add_relu vs the seeds' eager ``slow_add`` vs torch.compile.

A short, honest first look on the local device: correctness is checked
before anything is timed, and each case shows time, GB/s and the fraction
of the measured copy-bandwidth floor (3 N s bytes move: two reads, one write).
"""

from __future__ import annotations

import torch

import opforge

from .bench.timing import copy_bandwidth_gbps, time_fn
from .ops.add_bench import slow_add


def run(device: str | None = None) -> None:
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    sizes = [1 << 20, 1 << 24] + ([1 << 28] if device == "cuda" else [])
    bw = copy_bandwidth_gbps(device)
    compiled = torch.compile(slow_add, dynamic=False)
    print(f"opforge demo on {device}: add_relu vs eager slow_add vs torch.compile(slow_add); copy bandwidth {bw:.0f} GB/s")
    header = f"{'dtype':9} {'N':>10} {'opforge ms':>11} {'eager ms':>10} {'compile ms':>11} {'vs eager':>9} {'vs compile':>10} {'GB/s':>7} {'% floor':>8}"
    print(header)
    print("-" * len(header))
    for dtype in (torch.float32, torch.bfloat16):
        for n in sizes:
            x = torch.randn(n, device=device, dtype=dtype)
            y = torch.randn(n, device=device, dtype=dtype)
            ref = torch.relu(x.double() + y.double()).to(dtype)
            out = opforge.add_relu(x, y)
            if not torch.equal(out, ref):
                print(f"{str(dtype)[6:]:9} {n:>10} WRONG RESULT (max err {(out.double() - ref.double()).abs().max():.3g}); not timed")
                continue
            t_ours = time_fn(lambda: opforge.add_relu(x, y), device, quick=True).median_ms
            t_eager = time_fn(lambda: slow_add(x, y), device, quick=True).median_ms
            compiled(x, y)
            t_comp = time_fn(lambda: compiled(x, y), device, quick=True).median_ms
            nbytes = 3 * n * x.element_size()
            gbps = nbytes / (t_ours * 1e-3) / 1e9
            print(
                f"{str(dtype)[6:]:9} {n:>10} {t_ours:>11.4f} {t_eager:>10.4f} {t_comp:>11.4f} "
                f"{t_eager / t_ours:>8.2f}x {t_comp / t_ours:>9.2f}x {gbps:>7.0f} {100 * gbps / bw:>7.0f}%"
            )
