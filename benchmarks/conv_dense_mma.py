"""Dense 3x3 conv + bias + ReLU on the GPU: opforge's tensor-core kernel
(``torch.ops.opforge_bench.conv_dense_mma``) against cuDNN (F.conv2d + relu,
eager) and torch.compile of the same, in one run, with CUDA events.

    PYTHONPATH=src python benchmarks/conv_dense_mma.py [--dtype bfloat16|float16|float32] [--quick] [--tiles]

For each shape and input layout (channels_last, NCHW) it prints the median
time (p20-p80), TFLOP/s = 2*N*K*C*9*Ho*Wo / time, the fraction of the
measured dense matrix rate (torch.mm, 8192^3, same dtype) and the ratios
ours/cuDNN and ours/compiled (> 1 means ours is faster). An NCHW input costs
our kernel one extra NHWC conversion pass, included in its time. Inputs are
rotated over enough copies to exceed the L2 cache, and every provider's
output is checked against the others before timing. float32 runs with TF32
allowed for cuDNN convolutions (our kernel declines float32 otherwise).
--tiles also times each of the kernel's tile configurations forced through
OPFORGE_CONV_MMA_TILE (rows opforge[128x128] ...), to check its automatic pick.
"""

from __future__ import annotations

import argparse
import math
import os

import torch
import torch.nn.functional as F

import opforge  # noqa: F401  (registers the ops)
from opforge.bench.timing import time_cuda

SHAPES = [  # N, C, H, W, K  (stride 1, padding 1)
    (32, 64, 56, 56, 64),
    (8, 256, 28, 28, 256),
    (16, 128, 56, 56, 128),
]


def conv_relu(x, w, b):
    return F.relu(F.conv2d(x, w, b, stride=1, padding=1))


def matrix_rate_tflops(dtype) -> float:
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    t = time_cuda(lambda: torch.mm(a, b))
    return 2 * n**3 / (t.median_ms * 1e-3) / 1e12


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--quick", action="store_true", help="shorter timing runs")
    ap.add_argument("--tiles", action="store_true", help="also time each forced tile configuration")
    args = ap.parse_args()
    os.environ.pop("OPFORGE_CONV_MMA_TILE", None)  # the automatic pick, unless --tiles
    dtype = getattr(torch, args.dtype)
    rep_ms = 40.0 if args.quick else 200.0

    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cuda.matmul.allow_tf32 = True
    op = torch.ops.opforge_bench.conv_dense_mma
    compiled = torch.compile(conv_relu)
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    peak = matrix_rate_tflops(dtype)
    print(
        f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, {args.dtype}; "
        f"matrix rate (torch.mm 8192^3): {peak:.0f} TFLOP/s"
    )
    header = (
        f"{'shape':<22} {'layout':<6} {'provider':<16} {'median ms':>10} {'p20-p80 ms':>15} "
        f"{'TFLOP/s':>8} {'% rate':>7} {'vs cuDNN':>9} {'vs compile':>10}"
    )
    print(header)
    print("-" * len(header))

    for n, c, h, w, k in SHAPES:
        flops = 2 * n * k * c * 9 * h * w
        for layout in ("cl", "nchw"):
            fmt = torch.channels_last if layout == "cl" else torch.contiguous_format
            per_set = (n * c * h * w + n * k * h * w) * torch.finfo(dtype).bits // 8
            sets = max(1, math.ceil(3 * l2 / per_set))
            xs = [
                torch.randn(n, c, h, w, device="cuda", dtype=dtype).contiguous(memory_format=fmt) for _ in range(sets)
            ]
            wt = (torch.randn(k, c, 3, 3, device="cuda", dtype=dtype) / (3 * c**0.5)).contiguous(memory_format=fmt)
            b = torch.randn(k, device="cuda", dtype=dtype)

            # correctness first: all three providers agree
            ours = op(xs[0], wt, b, 1, 1, True)
            ref = conv_relu(xs[0], wt, b)
            comp = compiled(xs[0], wt, b)
            scale = ref.abs().max().item()
            d1 = (ours.float() - ref.float()).abs().max().item() / scale
            d2 = (comp.float() - ref.float()).abs().max().item() / scale
            assert d1 < 3e-2 and not torch.isnan(ours).any(), f"ours differs from cuDNN by {d1:.3g} (relative to max)"

            providers = {
                "opforge": (lambda x: op(x, wt, b, 1, 1, True), None),
                "cuDNN": (lambda x: conv_relu(x, wt, b), None),
                "compile": (lambda x: compiled(x, wt, b), None),
            }
            if args.tiles:
                for tile in ("128x128", "128x64", "64x64"):
                    if tile == "128x128" and dtype == torch.float32:
                        continue
                    providers[f"opforge[{tile}]"] = (lambda x: op(x, wt, b, 1, 1, True), tile)
            times = {}
            for name, (fn, tile) in providers.items():
                i = [0]

                def step(fn=fn):
                    fn(xs[i[0] % sets])
                    i[0] += 1

                if tile is not None:
                    os.environ["OPFORGE_CONV_MMA_TILE"] = tile
                    forced = op(xs[0], wt, b, 1, 1, True)
                    assert (forced.float() - ours.float()).abs().max().item() / scale < 3e-2, tile
                try:
                    times[name] = time_cuda(step, rep_ms=rep_ms)
                finally:
                    os.environ.pop("OPFORGE_CONV_MMA_TILE", None)
            shape = f"N{n} C{c} {h}x{w} K{k}"
            for name, t in times.items():
                tf = flops / (t.median_ms * 1e-3) / 1e12
                vs_cudnn = times["cuDNN"].median_ms / t.median_ms
                vs_comp = times["compile"].median_ms / t.median_ms
                print(
                    f"{shape:<22} {layout:<6} {name:<16} {t.median_ms:>10.4f} "
                    f"{t.p20_ms:>7.4f}-{t.p80_ms:<7.4f} {tf:>8.1f} {100 * tf / peak:>6.1f}% "
                    f"{vs_cudnn:>8.2f}x {vs_comp:>9.2f}x"
                )
            print(f"{'':<22} {layout:<6} max |diff| / max|ref| vs cuDNN: opforge {d1:.2e}, compile {d2:.2e}")


if __name__ == "__main__":
    main()
