"""Shape collection, timing and summary helpers shared by the layer sweeps (depthwise_sweep.py, pointwise_sweep.py)."""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time

import torch


def time_ms(fn, reps=20, rounds=5, device="cuda") -> float:
    """fn's median time per call in ms: CUDA events on the GPU, the host's clock on the CPU."""
    fn()
    if device == "cpu":
        out = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            out.append((time.perf_counter() - t0) * 1e3 / reps)
        return statistics.median(out)
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


def max_rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest absolute error against the float64 ``ref``, relative to ``ref``'s largest value."""
    return ((got.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def time_pair_ms(ours, theirs, reps=5, rounds=7) -> tuple[float, float]:
    """Both sides' median time per call in ms on the host's clock, taking turns round by round,
    so that a drift of the machine's speed (the CPU's) does not favour the side timed first."""
    ours(), theirs()
    samples = ([], [])
    for _ in range(rounds):
        for fn, out in zip((ours, theirs), samples):
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            out.append((time.perf_counter() - t0) * 1e3 / reps)
    return statistics.median(samples[0]), statistics.median(samples[1])


def copy_bandwidth_gbs(device="cuda") -> float:
    """Read + write bandwidth of a 256 MB device copy (64 MB on the CPU, into a touched buffer)."""
    x = torch.empty((256 if device == "cuda" else 64) * 2**20, dtype=torch.uint8, device=device)
    y = torch.empty_like(x).fill_(0)
    x.fill_(1)
    ms = time_ms(lambda: y.copy_(x), device=device)
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


def collect_conv_shapes(names, accept, key, image=224) -> dict[tuple, list[str]]:
    """{key(conv, input shape): [model names]} over the ``nn.Conv2d`` layers of torchvision's
    models ``names`` for which ``accept(conv)`` holds, read with forward hooks on one
    224x224 image (the shapes the models themselves give their layers)."""
    import torchvision

    shapes: dict[tuple, list[str]] = {}
    for name in names:
        model = getattr(torchvision.models, name)(weights=None).eval()
        hooks = []
        for m in model.modules():
            if not isinstance(m, torch.nn.Conv2d) or not accept(m):
                continue

            def hook(mod, args, name=name):
                models = shapes.setdefault(key(mod, tuple(args[0].shape)), [])
                if name not in models:
                    models.append(name)

            hooks.append(m.register_forward_pre_hook(hook))
        with torch.no_grad():
            model(torch.randn(1, 3, image, image))
        for h in hooks:
            h.remove()
    return shapes


def run_recorded(name: str, run, args: tuple, cases: list, errors: list, **extra) -> None:
    """``run(*args)`` as the sweep case ``name``: its result dict joins ``cases`` (with
    ``extra``), an exception joins ``errors``, reported and never skipped silently."""
    try:
        result = run(*args)
    except Exception as exc:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        errors.append({"case": name, "error": str(exc).splitlines()[0]})
        print(f"FAILED {name}: {errors[-1]['error']}", flush=True)
        return
    cases.append({**result, "case": name, **extra})


def write_report(summary: dict, cases: list, path: str | None) -> None:
    """Print the summary; with a path, write it and every case as JSON."""
    print(json.dumps(summary, indent=1))
    if path:
        with open(path, "w") as f:
            json.dump({"summary": summary, "cases": cases}, f, indent=1)


def sweep_parser(doc: str, batches: str, peer: str) -> argparse.ArgumentParser:
    """The arguments every sweep takes: --json, --device, --batches, --dtypes (and --max-seconds, read by
    ``fair_order``). ``peer``: what each case is timed against, for --device's help."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--json", help="write every case and the summary here")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help=f"peer: {peer}")
    ap.add_argument("--batches", default=batches)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--max-seconds", type=float, default=None, help="stop timing new shapes after this long")
    return ap


def parse_sweep_args(ap: argparse.ArgumentParser, argv, tool: str):
    """The parsed arguments, ``--dtypes`` as torch dtypes; None (said) where --device cuda has no GPU."""
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"{tool}: no CUDA GPU (--device cpu times the CPU's kernels)")
        return None
    args.dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]
    return args


def fair_order(shapes: dict, max_seconds: float | None):
    """The shapes' items in a fixed shuffled order, until ``max_seconds`` have passed: a run cut short is
    still a fair sample of them."""
    order = sorted(shapes.items())
    random.Random(0).shuffle(order)
    start = time.monotonic()
    for item in order:
        if max_seconds is not None and time.monotonic() - start > max_seconds:
            return
        yield item
