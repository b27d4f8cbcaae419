"""Depthwise 3x3 layers of real models: opforge.conv2d_3x3 against F.conv2d (cuDNN on CUDA, ATen on the CPU).

The layer shapes are collected from the models themselves (forward hooks on
torchvision's classification models at 224x224), never from a hand-written
list: every depthwise 3x3 conv opforge supports (stride 1 or 2, padding 0 or
1, zero padding, dilation 1), each distinct (C, H, W, stride, padding,
multiplier) once. Each is then timed at batch 1, 8 and 64, float32 and
bfloat16, NCHW and channels_last, forward (under no_grad) and backward
(grad x, weight and bias of one call), with the outputs checked first.

Reported as counts: cases slower than the peer, the geometric-mean
speed-up, the worst case, and, forward, the cases moving more than 8 MB
that run under 60% of the device-copy floor (input read once, output
written once, at the copy bandwidth measured in the same run).

    python tools/depthwise_sweep.py --json sweep.json
    python tools/depthwise_sweep.py --device cpu --batches 1,8 --json cpu-sweep.json

On the CPU the peer is ATen's convolution (oneDNN), the floor a copy between
two touched 64 MB buffers; the outputs are fresh tensors, so cases whose
output is over ~16 MB also time the page faults of their first touch.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from sweep_common import (
    collect_conv_shapes,
    copy_bandwidth_gbs,
    max_rel_err,
    run_recorded,
    summarize,
    time_ms,
    time_pair_ms,
    write_report,
)

MODELS = (
    "mobilenet_v2",
    "mobilenet_v3_large",
    "mobilenet_v3_small",
    "efficientnet_b0",
    "mnasnet1_0",
    "shufflenet_v2_x1_0",
    "regnet_y_400mf",
)


def _supported_depthwise(m: torch.nn.Conv2d) -> bool:
    if m.kernel_size != (3, 3) or m.groups == 1 or m.groups != m.in_channels:
        return False
    if m.dilation != (1, 1) or m.padding_mode != "zeros" or m.stride[0] != m.stride[1]:
        return False
    return m.stride[0] in (1, 2) and m.padding in ((0, 0), (1, 1))


def collect_shapes(names=MODELS, image=224) -> dict[tuple, list[str]]:
    """{(C, H, W, stride, padding, multiplier): [model names]} of the supported depthwise 3x3 convs."""
    return collect_conv_shapes(
        names,
        _supported_depthwise,
        lambda m, s: (s[1], s[2], s[3], m.stride[0], m.padding[0], m.out_channels // s[1]),
        image,
    )


def run_case(key, n, dtype, channels_last, backward=True, device="cuda"):
    import opforge

    c, h, w, s, p, mult = key
    x = torch.randn(n, c, h, w, device=device, dtype=dtype)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    wt = torch.randn(c * mult, 1, 3, 3, device=device, dtype=dtype)
    b = torch.randn(c * mult, device=device, dtype=dtype)

    def timed(ours, theirs):
        # The CPU's sides take turns (its speed drifts), with fewer calls: its cases take milliseconds.
        if device == "cpu":
            return time_pair_ms(ours, theirs)
        return time_ms(ours), time_ms(theirs)

    with torch.no_grad():
        ours = opforge.conv2d_3x3(x, wt, b, s, p, c)
        ref = F.conv2d(x.double(), wt.double(), b.double(), s, p, 1, c)
        err = max_rel_err(ours, ref)
        fwd = timed(lambda: opforge.conv2d_3x3(x, wt, b, s, p, c), lambda: F.conv2d(x, wt, b, s, p, 1, c))
    moved = (x.numel() + ours.numel()) * x.element_size()
    if not backward:
        return {"fwd": fwd, "bytes": moved, "max_rel_err": err}
    g = torch.randn_like(ours)

    def bwd(fn):
        xg, wg, bg = (t.detach().requires_grad_() for t in (x, wt, b))
        out = fn(xg, wg, bg)
        return lambda: torch.autograd.grad(out, (xg, wg, bg), g, retain_graph=True)

    bwd_ms = timed(
        bwd(lambda xx, ww, bb: opforge.conv2d_3x3(xx, ww, bb, s, p, c)),
        bwd(lambda xx, ww, bb: F.conv2d(xx, ww, bb, s, p, 1, c)),
    )
    return {"fwd": fwd, "bwd": bwd_ms, "bytes": moved, "max_rel_err": err}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write every case and the summary here")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="peer: cuDNN (cuda) or ATen (cpu)")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--layouts", default="nchw,channels_last", help="nchw, channels_last or both (the default)")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--forward-only", action="store_true", help="time the forward alone")
    args = ap.parse_args(argv)
    layouts = [{"nchw": False, "channels_last": True}[name] for name in args.layouts.split(",")]
    dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]
    if args.device == "cuda" and not torch.cuda.is_available():
        print("depthwise_sweep: no CUDA GPU (--device cpu times the CPU kernels)")
        return 2
    shapes = collect_shapes()
    floor = copy_bandwidth_gbs(args.device)
    cases, errors = [], []
    for key, models in sorted(shapes.items()):
        for n in (int(b) for b in args.batches.split(",")):
            for dtype in dtypes:
                for cl in layouts:
                    name = f"N{n} C{key[0]} {key[1]}x{key[2]} s{key[3]} p{key[4]} m{key[5]} {str(dtype)[6:]} "
                    name += ("NHWC" if cl else "NCHW") + f" ({','.join(models)})"
                    case_args = (key, n, dtype, cl, not args.forward_only, args.device)
                    run_recorded(name, run_case, case_args, cases, errors)
    summary = {
        "device": args.device,
        "threads": torch.get_num_threads(),
        "shapes": len(shapes),
        "copy_gbs": floor,
        "forward": summarize(cases, "fwd", floor),
        "backward": summarize(cases, "bwd") if not args.forward_only else None,
        "max_rel_err": max(c["max_rel_err"] for c in cases),
        "failed": errors,
    }
    write_report(summary, cases, args.json)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
