"""The ``opforge bench`` and ``opforge demo`` subcommands (argument wiring).

It imports nothing of the ``opforge`` command that adds these parsers, so
the command can import it without a cycle.
"""

from __future__ import annotations

import argparse

DTYPE_NAMES = {
    "float32": "float32",
    "fp32": "float32",
    "f32": "float32",
    "float64": "float64",
    "fp64": "float64",
    "f64": "float64",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}


def _dtypes(text: str):
    """``float32,bf16`` -> [torch.float32, torch.bfloat16]."""
    import torch

    out = []
    for part in filter(None, text.split(",")):
        name = DTYPE_NAMES.get(part.strip().lower())
        if name is None:
            raise argparse.ArgumentTypeError(
                f"unknown dtype {part!r}; expected one of {', '.join(sorted(set(DTYPE_NAMES)))}"
            )
        out.append(getattr(torch, name))
    return out


def _modes(text: str):
    """``fwd,full`` -> ["fwd", "full"]."""
    out = [m.strip() for m in text.split(",") if m.strip()]
    for m in out:
        if m not in ("fwd", "bwd", "full", "all"):
            raise argparse.ArgumentTypeError(f"unknown mode {m!r}; expected fwd, bwd, full or all")
    return out


def add_parsers(sub) -> None:
    """Adds ``bench`` and ``demo`` to the ``opforge`` command's subparsers."""
    p = sub.add_parser(
        "bench",
        help="time opforge's ops against eager PyTorch, torch.compile and peers",
        description="Time every registered op case (or those named) against eager PyTorch, torch.compile "
        "and peers; correctness is checked first. See docs/bench.md.",
    )
    _add_bench_arguments(p)
    p.set_defaults(func=run_bench)

    p = sub.add_parser("demo", help="the quick benchmark on this machine (same as `opforge bench --quick`)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if available")
    p.set_defaults(func=run_demo)


def _add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("ops", nargs="*", metavar="OPS", help="op families or op names (default: all registered)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if available, else cpu")
    p.add_argument(
        "--dtype",
        type=_dtypes,
        action="extend",
        default=None,
        help="only these dtypes, comma-separated or repeated (e.g. float32,bf16)",
    )
    p.add_argument(
        "--mode",
        type=_modes,
        action="extend",
        default=None,
        help="fwd, bwd (backward alone), full (forward + backward) or all, comma-separated or "
        "repeated; default: all (with --quick: fwd)",
    )
    p.add_argument(
        "--quick", action="store_true", help="the cases marked quick, shorter timing (< 2 min on 2 CPU cores)"
    )
    p.add_argument("--no-compile", dest="compile", action="store_false", help="skip torch.compile")
    p.add_argument("--json", metavar="PATH", help="write the results and environment as JSON")
    p.add_argument("--markdown", metavar="PATH", help="write a Markdown report")
    p.add_argument("--plot", metavar="PATH", help="write a PNG chart (needs matplotlib)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar on stderr")
    p.add_argument(
        "--from-json",
        metavar="PATH",
        help="time nothing: print and write (--markdown, --plot) the results saved in PATH by --json",
    )
    from . import models_cli, overhead_cli

    overhead_cli.add_arguments(p)  # `opforge bench overhead [OPS]`
    models_cli.add_arguments(p)  # `opforge bench models`


def run_bench(args) -> int:
    """Runs the benchmark; exit status 1 if any opforge result was WRONG (or errored)."""
    import torch

    from . import harness, models_cli, overhead_cli, report

    commands = (models_cli, overhead_cli)
    chosen = next((command for command in commands if command.wanted(args)), None)
    for command in commands:
        stray = command.own_options_given(args) if command is not chosen else []
        if stray:
            verb = "applies" if len(stray) == 1 else "apply"
            print(f"opforge bench: {', '.join(stray)} {verb} to `opforge bench {command.NAME}` only")
            return 2
    if chosen is not None:
        return chosen.run(args)
    if args.from_json:
        if args.ops or args.device or args.dtype or args.mode or args.quick or not args.compile or args.json:
            print(
                "opforge bench: --from-json redraws a saved run; it takes no ops, --device, --dtype, --mode, "
                "--quick, --no-compile or --json"
            )
            return 2
        run = report.read_json(args.from_json)
        return _write_outputs(run, args)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("opforge bench: --device cuda, but torch sees no CUDA GPU")
        return 2
    modes = args.mode or (["fwd"] if args.quick else ["all"])
    modes = harness.MODES if "all" in modes else tuple(m for m in harness.MODES if m in modes)
    settings = harness.Settings(
        device=device,
        quick=args.quick,
        modes=modes,
        dtypes=tuple(args.dtype) if args.dtype else None,
        ops=tuple(args.ops),
        compile=args.compile,
    )
    known = harness.known_names(device)
    unknown = [o for o in settings.ops if o not in known]
    if unknown:
        print(f"opforge bench: unknown op {', '.join(unknown)}; registered: {', '.join(sorted(known))}")
        return 2
    run = harness.run(settings, progress=args.progress)
    return _write_outputs(run, args)


def _write_outputs(run, args) -> int:
    """Prints the table, writes the files asked for; 1 if any opforge result was not ok."""
    from . import report

    print(report.table(run))
    if args.json:
        report.write_json(run, args.json)
        print(f"wrote {args.json}")
    if args.markdown:
        report.write_markdown(run, args.markdown)
        print(f"wrote {args.markdown}")
    if args.plot:
        report.write_plot(run, args.plot)
        print(f"wrote {args.plot}")
    bad = [r for r in run.results if r.providers["opforge"].status != "ok"]
    return 1 if bad else 0


def demo_args(device: str | None = None) -> argparse.Namespace:
    """The arguments of ``opforge bench --quick [--device DEVICE]``, which ``opforge demo`` runs."""
    p = argparse.ArgumentParser(prog="opforge bench")
    _add_bench_arguments(p)
    return p.parse_args(["--quick"] + (["--device", device] if device else []))


def run_demo(args) -> int:
    return run_bench(demo_args(args.device))
