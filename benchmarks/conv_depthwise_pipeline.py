"""Stride-1 depthwise 3x3 (+ bias + ReLU) on the GPU: opforge's launch rule
against each launch OPFORGE_CONV_DW_PIPELINE can force, in one run, with CUDA
events.

    PYTHONPATH=src python benchmarks/conv_depthwise_pipeline.py [--dtype bfloat16,float32] [--quick]

"off" is one tile per block (a block stages its tile, then computes it); "on"
and "1".."4" are blocks walking tiles with two stage buffers (the next tile's
copies in flight while the current one is computed), as many blocks as fit or
at most that many per SM. For each shape, layout and launch it prints the
median time (p20-p80), the bandwidth as % of the floor (reading x once and
writing the output once, at the rate of a 1 GiB device copy) and as % of a
device copy of the same bytes timed alongside. Every forced launch must give
bit-identical output to the rule's (the per-output arithmetic is the same).
"""

from __future__ import annotations

import argparse
import math
import os

import torch

import opforge
from opforge.bench.timing import time_cuda

SHAPES = [  # N, C, H, W (stride 1, padding 1, multiplier 1)
    (32, 64, 56, 56),
    (8, 256, 28, 28),
    (64, 128, 112, 112),
    (16, 32, 224, 224),
]
LAUNCHES = ["rule", "off", "on", "1", "2", "3", "4"]
ENV = "OPFORGE_CONV_DW_PIPELINE"


def copy_rate_gbps() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = time_cuda(lambda: dst.copy_(src))
    return 2 * src.numel() / (t.median_ms * 1e-3) / 1e9


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16,float32", help="comma-separated")
    ap.add_argument("--quick", action="store_true", help="shorter timing runs")
    args = ap.parse_args()
    os.environ.pop(ENV, None)
    rep_ms = 30.0 if args.quick else 150.0
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    floor = copy_rate_gbps()
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}; device copy {floor:.0f} GB/s")
    header = (f"{'shape':<20} {'dtype':<9} {'layout':<6} {'launch':<6} {'median ms':>10} {'p20-p80 ms':>15} "
              f"{'GB/s':>7} {'% floor':>8} {'% of copy':>9}")
    print(header)
    print("-" * len(header))
    for dtype in (getattr(torch, d) for d in args.dtype.split(",")):
        for n, c, h, w in SHAPES:
            for layout in ("NCHW", "NHWC"):
                fmt = torch.channels_last if layout == "NHWC" else torch.contiguous_format
                nbytes = 2 * n * c * h * w * torch.finfo(dtype).bits // 8
                sets = max(1, min(32, math.ceil(4 * l2 / nbytes)))
                xs = [torch.randn(n, c, h, w, device="cuda", dtype=dtype).contiguous(memory_format=fmt)
                      for _ in range(sets)]
                wt = torch.randn(c, 1, 3, 3, device="cuda", dtype=dtype) / 3
                b = torch.randn(c, device="cuda", dtype=dtype)

                def run(x):
                    return opforge.conv2d_3x3(x, wt, b, 1, 1, c, "relu")

                expected = run(xs[0])
                src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
                dst = torch.empty_like(src)
                copy = time_cuda(lambda: dst.copy_(src), rep_ms=rep_ms)
                for launch in LAUNCHES:
                    if launch != "rule":
                        os.environ[ENV] = launch
                    try:
                        got = run(xs[0])
                        assert torch.equal(got, expected), f"{launch}: output differs from the rule's"
                        i = [0]

                        def step():
                            run(xs[i[0] % sets])
                            i[0] += 1

                        t = time_cuda(step, rep_ms=rep_ms)
                    finally:
                        os.environ.pop(ENV, None)
                    gbps = nbytes / (t.median_ms * 1e-3) / 1e9
                    print(f"{f'N{n} C{c} {h}x{w}':<20} {str(dtype).removeprefix('torch.'):<9} {layout:<6} "
                          f"{launch:<6} {t.median_ms:>10.4f} {t.p20_ms:>7.4f}-{t.p80_ms:<7.4f} {gbps:>7.0f} "
                          f"{100 * gbps / floor:>7.0f}% {100 * copy.median_ms / t.median_ms:>8.0f}%")


if __name__ == "__main__":
    main()
