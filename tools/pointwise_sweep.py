"""1x1 conv layers of real models: opforge.conv2d_1x1 against F.conv2d + the activation (cuDNN / ATen).

The layer shapes are collected from the models themselves (forward hooks on
torchvision's classification models at 224x224): every 1x1 conv with groups
1 and no padding, each distinct (C, K, H, W, stride) once. Each is timed at
the given batches, float32 and bfloat16, NCHW and channels_last, forward
under no_grad, as the layer runs after optimize folds a BatchNorm into it:
with a bias, once without an activation (a projection) and once with
hardswish after it (any activation costs torch one more pass), outputs
checked first. The backward is ATen's in both, so it is not swept.

Reported as counts: cases slower than the peer, the geometric-mean
speed-up, the worst case, and the cases moving more than 8 MB that run
under 60% of the device-copy floor (input read once, output written once).

    python tools/pointwise_sweep.py --json sweep.json
    python tools/pointwise_sweep.py --device cpu --batches 1 --dtypes float32 --json cpu-sweep.json
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from sweep_common import (
    collect_conv_shapes,
    copy_bandwidth_gbs,
    fair_order,
    max_rel_err,
    parse_sweep_args,
    run_recorded,
    summarize,
    sweep_parser,
    time_ms,
    write_report,
)

MODELS = (
    "mobilenet_v2",
    "mobilenet_v3_large",
    "mobilenet_v3_small",
    "efficientnet_b0",
    "mnasnet1_0",
    "resnet18",
    "resnet50",
    "regnet_y_400mf",
)


def collect_shapes(names=MODELS, image=224) -> dict[tuple, list[str]]:
    """{(C, K, H, W, stride): [model names]} of the 1x1 convs opforge.conv2d_1x1 runs."""
    return collect_conv_shapes(
        names,
        lambda m: (
            m.kernel_size == (1, 1) and m.groups == 1 and m.padding in ((0, 0), "valid") and m.stride[0] == m.stride[1]
        ),
        lambda m, s: (s[1], m.out_channels, s[2], s[3], m.stride[0]),
        image,
    )


_TORCH_ACT = {None: lambda t: t, "hardswish": F.hardswish}


def run_case(key, n, dtype, channels_last, activation, device="cuda"):
    import opforge

    c, k, h, w, s = key
    x = torch.randn(n, c, h, w, device=device, dtype=dtype)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    wt = torch.randn(k, c, 1, 1, device=device, dtype=dtype) / c**0.5
    b = torch.randn(k, device=device, dtype=dtype)
    act = _TORCH_ACT[activation]
    with torch.no_grad():
        ours = opforge.conv2d_1x1(x, wt, b, s, activation)
        ref = act(F.conv2d(x.double(), wt.double(), b.double(), s))
        err = max_rel_err(ours, ref)
        fwd = (
            time_ms(lambda: opforge.conv2d_1x1(x, wt, b, s, activation), 10, 3, device),
            time_ms(lambda: act(F.conv2d(x, wt, b, s)), 10, 3, device),
        )
    moved = (x.numel() + ours.numel()) * x.element_size()
    return {"fwd": fwd, "bytes": moved, "max_rel_err": err}


def main(argv=None) -> int:
    ap = sweep_parser(__doc__, "1,64", "cuDNN (cuda) or ATen (cpu)")
    args = parse_sweep_args(ap, argv, "pointwise_sweep")
    if args is None:
        return 2
    dtypes = args.dtypes
    shapes = collect_shapes()
    floor = copy_bandwidth_gbs(args.device)
    cases, errors = [], []
    done = 0
    for key, models in fair_order(shapes, args.max_seconds):
        done += 1
        for n in (int(b) for b in args.batches.split(",")):
            for dtype in dtypes:
                for cl in (False, True):
                    for activation in (None, "hardswish"):
                        name = f"N{n} C{key[0]}->{key[1]} {key[2]}x{key[3]} s{key[4]} {str(dtype)[6:]} "
                        name += ("NHWC" if cl else "NCHW") + f" {activation or 'bias'} ({','.join(models)})"
                        case_args = (key, n, dtype, cl, activation, args.device)
                        run_recorded(name, run_case, case_args, cases, errors, layout="NHWC" if cl else "NCHW")
    summary = {
        "device": args.device,
        "threads": torch.get_num_threads(),
        "shapes": len(shapes),
        "shapes_timed": done,
        "copy_gbs": floor,
        "forward": summarize(cases, "fwd", floor),
        "max_rel_err": max(c["max_rel_err"] for c in cases),
        "failed": errors,
    }
    for layout in ("NHWC", "NCHW"):
        summary[f"forward_{layout}"] = summarize([c for c in cases if c["layout"] == layout], "fwd", floor)
    write_report(summary, cases, args.json)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
