"""Timing and summary helpers shared by the layer sweeps (depthwise_sweep.py, pointwise_sweep.py)."""

from __future__ import annotations

import math
import statistics

import torch


def time_ms(fn, reps=20, rounds=5) -> float:
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        out.append(start.elapsed_time(end) / reps)
    return statistics.median(out)


def copy_bandwidth_gbs() -> float:
    x = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = time_ms(lambda: y.copy_(x))
    return 2 * x.numel() / ms / 1e6


def summarize(cases, direction, floor_gbs=None):
    speed = [c[direction][1] / c[direction][0] for c in cases]
    worst = min(range(len(cases)), key=lambda i: speed[i])
    out = {
        "cases": len(cases),
        "slower_than_peer": sum(v < 1.0 for v in speed),
        "geomean_speedup": math.exp(sum(math.log(v) for v in speed) / len(speed)),
        "worst": {"speedup": speed[worst], **{k: cases[worst][k] for k in ("case", direction)}},
    }
    if floor_gbs:
        big = [c for c in cases if c["bytes"] > 8e6]
        frac = [c["bytes"] / (c["fwd"][0] * 1e-3) / (floor_gbs * 1e9) for c in big]
        out["over_8MB"] = len(big)
        out["over_8MB_under_60pct_floor"] = sum(f < 0.6 for f in frac)
    return out
