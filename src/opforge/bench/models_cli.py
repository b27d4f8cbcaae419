"""``opforge bench models``: its options, and how the ``bench`` command runs it."""

from __future__ import annotations

import argparse

from .models_spec import MODELS, PROVIDERS

NAME = "models"


def _csv(choices):
    def parse(text: str) -> list[str]:
        items = [t for t in text.split(",") if t]
        bad = [t for t in items if choices and t not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(bad)}; choose from {', '.join(choices)}")
        return items

    return parse


def _int_or_zero(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        return 0


def _positive_int(text: str) -> int:
    value = _int_or_zero(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _positive_ints(text: str) -> list[int]:
    values = [_int_or_zero(t) for t in text.split(",") if t.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer or a comma-separated list of them, got {text!r}")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        f"opforge bench {NAME}",
        "whole torchvision models end to end: eager, torch.compile (with freezing, reduce-overhead), "
        "opforge.optimize and both together",
    )
    g.add_argument("--models", type=_csv(MODELS), default=None, help=f"default: {','.join(MODELS)}")
    g.add_argument("--batches", type=_positive_ints, default=None, help="default: 1,64 on CUDA, 1 on CPU")
    g.add_argument("--dtypes", type=_csv(("float32", "bfloat16")), default=None, help="default: both (CPU: float32)")
    g.add_argument("--layouts", type=_csv(("channels_last", "nchw")), default=None, help="default: both")
    g.add_argument("--modes", type=_csv(("inference", "train")), default=None, help="default: both")
    g.add_argument("--providers", type=_csv(PROVIDERS), default=None, help="default: all that apply")
    g.add_argument("--image", type=_positive_int, default=None, help="input height and width (default 224)")
    g.add_argument(
        "--merge",
        nargs="+",
        metavar="JSON",
        default=None,
        help="run nothing: merge the results of earlier --json files into one table (--json / --markdown / --plot); "
        "a cell in several files keeps its result from the last of them",
    )


_CELL_OPTIONS = ("models", "batches", "dtypes", "layouts", "modes", "providers")


def wanted(args) -> bool:
    return bool(args.ops) and args.ops[0] == NAME


def own_options_given(args) -> list[str]:
    """This command's options set on the command line, so that another ``bench`` can refuse them."""
    return [f"--{n}" for n in (*_CELL_OPTIONS, "image", "merge") if getattr(args, n) is not None]


def _misused(args) -> str | None:
    """What in ``args`` this command would otherwise ignore, said with what it takes instead."""
    if len(args.ops) > 1:
        return f"takes no OPS (got {' '.join(args.ops[1:])}); name models with --models"
    instead = {"dtype": "--dtypes", "mode": "--modes (inference,train)"}
    for name, other in instead.items():
        if getattr(args, name):
            return f"--{name} is the op benchmark's; use {other}"
    if not args.compile:
        return "--no-compile is the op benchmark's; choose providers with --providers (e.g. eager,optimize)"
    if args.from_json and args.merge:
        return "--from-json redraws one saved run and --merge several: give one of them"
    if args.from_json or args.merge:
        option = "--from-json" if args.from_json else "--merge"
        selecting = [f"--{n}" for n in (*_CELL_OPTIONS, "image", "device") if getattr(args, n) is not None]
        selecting += ["--quick"] if args.quick else []
        if selecting:
            return f"{option} runs nothing; {', '.join(selecting)} would select cells to run"
        if args.from_json and args.json:
            return "--from-json redraws a saved run; write a merged JSON with --merge PATH --json OUT"
    return None


def run(args) -> int:
    import torch

    from . import machine, models, models_report

    problem = _misused(args)
    if problem:
        print(f"opforge bench {NAME}: {problem}")
        return 2
    if args.from_json:
        args.merge = [args.from_json]
    if args.merge:
        return _merge(args, models_report)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print(f"opforge bench {NAME}: --device cuda, but torch sees no CUDA GPU")
        return 2
    try:
        import torchvision  # noqa: F401
    except ImportError:
        print(f"opforge bench {NAME}: needs torchvision (pip install torchvision)")
        return 2
    batches = args.batches or ([1, 64] if device == "cuda" else [1])
    todo = models.cells(
        [device],
        args.models or (list(MODELS[:1]) if args.quick else list(MODELS)),
        args.dtypes or ["float32", "bfloat16"],
        batches,
        args.layouts or ["channels_last", "nchw"],
        args.modes or (["inference"] if args.quick else ["inference", "train"]),
        args.image or 224,
    )
    calls, repeats = (3, 3) if args.quick else (10, 5)
    load_at_start = machine.load_average()
    results = []
    for i, cell in enumerate(todo):
        if args.progress:
            print(f"[{i + 1}/{len(todo)}] {models_report.cell_label(cell)}", flush=True)
        results.append(models.run_cell(cell, calls, repeats, only=tuple(args.providers or ())))
        if args.json:
            # After every cell: a run cut short keeps the cells it finished.
            models_report.write_json(results, args.json, device, machine.environment(device, load_at_start))
    print(models_report.table(results))
    if args.json:
        models_report.write_json(results, args.json, device, machine.environment(device, load_at_start))
        print(f"wrote {args.json}")
    if args.markdown:
        models_report.write_markdown(results, args.markdown, device)
        print(f"wrote {args.markdown}")
    _plot(args, models_report, results)
    return 1 if any(t.status.startswith("failed") for r in results for t in r.providers.values()) else 0


def _merge(args, models_report) -> int:
    by_cell, replaced = {}, 0
    for path in args.merge:
        try:
            _, r = models_report.read_json(path)
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"opforge bench {NAME}: cannot read {path}: {e}")
            return 2
        for result in r:
            # A rerun of a cell replaces it in place: the table keeps the first file's order.
            replaced += result.cell in by_cell
            by_cell[result.cell] = result
    results = list(by_cell.values())
    device = results[0].cell.device if results else "cpu"
    # Each cell keeps the environment of the run that measured it; the file's is what they share.
    env = models_report.common_environment(results)
    print(models_report.table(results))
    if replaced:
        print(f"{replaced} cell(s) measured again in a later file: the later result is kept")
    if args.json:
        models_report.write_json(results, args.json, device, env)
        print(f"wrote {args.json}")
    if args.markdown:
        models_report.write_markdown(results, args.markdown, device, env)
        print(f"wrote {args.markdown}")
    _plot(args, models_report, results)
    return 0


def _plot(args, models_report, results) -> None:
    if not args.plot:
        return
    try:
        models_report.write_plot(results, args.plot)
    except ImportError:
        print(f"opforge bench {NAME}: --plot needs matplotlib (pip install matplotlib); no chart written")
        return
    print(f"wrote {args.plot}")
