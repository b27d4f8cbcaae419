"""Conv -> BatchNorm (training) -> [+ residual] -> ReLU of real models: opforge.conv2d_batch_norm against the modules.

The layer shapes are collected from the models themselves (forward hooks on
torchvision's classification models at 224x224): every conv that a
BatchNorm2d reads, each distinct (C, K, kernel, H, W, stride, padding,
groups) once. Each is timed at the given batches, float32 and bfloat16,
channels_last (the layout the CUDA engine takes; on the CPU both layouts),
as a training step of the layer sees it: forward, and forward + backward
(gradients of x, the conv weight, the BatchNorm's affine parameters and the
residual), once as ``relu(bn(conv(x)))`` and once as a residual tail
``relu(bn(conv(x)) + shortcut)``. The peer is the eager composite of
``F.conv2d``, ``F.batch_norm(training=True)``, the add and ``F.relu``. The
output (max relative error) and every gradient (relative error as a
norm) are checked against float64 first, next to the peer's own errors.

Reported as counts: cases slower than the peer, the geometric-mean
speed-up and the worst case, forward and forward + backward.

    python tools/batch_norm_sweep.py --json sweep.json
    python tools/batch_norm_sweep.py --device cpu --batches 8 --dtypes float32 --json cpu-sweep.json
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from sweep_common import (
    collect_conv_shapes,
    fair_order,
    max_rel_err,
    parse_sweep_args,
    run_recorded,
    summarize,
    sweep_parser,
    time_ms,
    write_report,
)

MODELS = ("resnet18", "resnet50", "mobilenet_v2", "mobilenet_v3_large", "regnet_y_400mf")


def collect_shapes(names=MODELS, image=224) -> dict[tuple, list[str]]:
    """{(C, K, kH, kW, H, W, stride, padding, groups): [model names]} of the convs a BatchNorm2d reads
    (torchvision's classification models put one after every conv but the classifier's)."""

    def takes(m):
        return m.bias is None and m.padding_mode == "zeros" and m.dilation == (1, 1) and not isinstance(m.padding, str)

    def key(m, s):
        return (s[1], m.out_channels, *m.kernel_size, s[2], s[3], m.stride[0], m.padding[0], m.groups)

    return collect_conv_shapes(names, takes, key, image)


def _composite(x, w, g, b, mean, var, stride, padding, groups, residual):
    y = F.batch_norm(F.conv2d(x, w, None, stride, padding, 1, groups), mean, var, g, b, True, 0.1, 1e-5)
    return F.relu(y if residual is None else y + residual)


def _ours(x, w, g, b, mean, var, stride, padding, groups, residual):
    import opforge

    return opforge.conv2d_batch_norm(
        x, w, None, g, b, mean, var, None, stride, padding, 1, groups, 0.1, 1e-5, "relu", residual
    )


def _norm_rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """A gradient's error as a norm: where a rounding moves a pre-activation across ReLU's kink one
    element's gradient is rightly 0 on one side and the upstream on the other; a max would report it."""
    return ((got.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def run_case(key, n, dtype, channels_last, with_residual, device="cuda"):
    c, k, kh, kw, h, w, s, p, groups = key
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randn(n, c, h, w, device=device, dtype=dtype).to(memory_format=fmt)
    wt = (torch.randn(k, c // groups, kh, kw, device=device, dtype=dtype) / (c // groups * kh * kw) ** 0.5).to(
        memory_format=fmt
    )
    g = torch.rand(k, device=device, dtype=dtype) + 0.5
    b = torch.randn(k, device=device, dtype=dtype)
    ho, wo = (h + 2 * p - kh) // s + 1, (w + 2 * p - kw) // s + 1
    res = torch.randn(n, k, ho, wo, device=device, dtype=dtype).to(memory_format=fmt) if with_residual else None
    leaves = [t for t in (x, wt, g, b, res) if t is not None]

    def call(fn, tensors, stats):
        xx, ww, gg, bb, *rr = tensors
        return fn(xx, ww, gg, bb, *stats, s, p, groups, rr[0] if rr else None)

    def stats(dt):
        return torch.zeros(k, device=device, dtype=dt), torch.ones(k, device=device, dtype=dt)

    # Correctness: output and gradients against the float64 composite, one upstream gradient.
    ref_in = [t.detach().double().requires_grad_() for t in leaves]
    ref_out = call(_composite, ref_in, stats(torch.float64))
    grad = torch.randn_like(ref_out)
    ref_out.backward(grad)
    errors = {}
    for label, fn in (("", _ours), ("peer_", _composite)):
        got_in = [t.detach().clone().requires_grad_() for t in leaves]
        out = call(fn, got_in, stats(dtype))
        out.backward(grad.to(dtype))
        errors[label + "max_rel_err"] = max_rel_err(out, ref_out)
        errors[label + "grad_rel_err"] = max(_norm_rel_err(a.grad, r.grad) for a, r in zip(got_in, ref_in))

    run_stats = stats(dtype)
    upstream = grad.to(dtype).to(memory_format=fmt)
    params = [t.detach().requires_grad_() for t in leaves]

    def forward(fn):
        def run():
            with torch.no_grad():
                call(fn, leaves, run_stats)

        return run

    def step(fn):
        def run():
            torch.autograd.backward(call(fn, params, run_stats), upstream, inputs=params)
            for t in params:
                t.grad = None

        return run

    return {
        "fwd": (time_ms(forward(_ours), 10, 3, device), time_ms(forward(_composite), 10, 3, device)),
        "full": (time_ms(step(_ours), 10, 3, device), time_ms(step(_composite), 10, 3, device)),
        **errors,
    }


def _worst_by_dtype(cases, dtypes, key) -> dict:
    names = [str(dt)[6:] for dt in dtypes]
    return {name: max((c[key] for c in cases if c["dtype"] == name), default=None) for name in names}


def main(argv=None) -> int:
    ap = sweep_parser(__doc__, "64", "the eager modules (cuDNN or ATen)")
    args = parse_sweep_args(ap, argv, "batch_norm_sweep")
    if args is None:
        return 2
    dtypes = args.dtypes
    layouts = (True,) if args.device == "cuda" else (False, True)
    shapes = collect_shapes()
    cases, errors = [], []
    done = 0
    for key, models in fair_order(shapes, args.max_seconds):
        done += 1
        c, k, kh, kw, h, w, s, p, groups = key
        for n in (int(v) for v in args.batches.split(",")):
            for dtype in dtypes:
                for cl in layouts:
                    for residual in (False, True):
                        name = f"N{n} C{c}->{k} {kh}x{kw} g{groups} {h}x{w} s{s} p{p} {str(dtype)[6:]} "
                        name += ("NHWC" if cl else "NCHW") + (" +res" if residual else "") + f" ({','.join(models)})"
                        case_args = (key, n, dtype, cl, residual, args.device)
                        run_recorded(name, run_case, case_args, cases, errors, dtype=str(dtype)[6:])
    summary = {
        "device": args.device,
        "threads": torch.get_num_threads(),
        "shapes": len(shapes),
        "shapes_timed": done,
        "forward": summarize(cases, "fwd"),
        "forward_backward": summarize(cases, "full"),
        "max_rel_err_by_dtype": _worst_by_dtype(cases, dtypes, "max_rel_err"),
        "grad_rel_err_by_dtype": _worst_by_dtype(cases, dtypes, "grad_rel_err"),
        "peer_max_rel_err_by_dtype": _worst_by_dtype(cases, dtypes, "peer_max_rel_err"),
        "peer_grad_rel_err_by_dtype": _worst_by_dtype(cases, dtypes, "peer_grad_rel_err"),
        "failed": errors,
    }
    write_report(summary, cases, args.json)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
