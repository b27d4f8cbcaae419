"""``opforge bench overhead [OPS]``: its options and how the ``bench`` command runs it.

It shares ``bench``'s parser (``overhead`` is the first of the positional
OPS), so ``--device``, ``--quick``, ``--json``, ``--markdown``,
``--no-progress`` and ``--from-json`` mean what they mean there.
"""

from __future__ import annotations

import argparse

NAME = "overhead"


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        f"opforge bench {NAME} [OPS]",
        "the host's time per call of every op on tiny inputs, next to the torch code it "
        "replaces and a no-op floor (OPS: ops whose names start with these)",
    )
    g.add_argument("--calls", type=_positive, default=None, help="calls per timed loop (default 200; --quick 50)")
    g.add_argument("--repeats", type=_positive, default=None, help="timed loops per provider (default 15; --quick 5)")
    g.add_argument("--threads", type=_positive, default=None, help="torch's CPU threads (default: torch's own)")


def wanted(args) -> bool:
    return bool(args.ops) and args.ops[0] == NAME


def own_options_given(args) -> list[str]:
    """This command's options set on the command line, so that another ``bench`` can refuse them."""
    return [f"--{n}" for n in ("calls", "repeats", "threads") if getattr(args, n) is not None]


def run(args) -> int:
    """Runs (or, with --from-json, redraws) the overhead benchmark; 1 if any row was WRONG or failed."""
    import torch

    from . import overhead, overhead_report

    others = [f"--{n}" for n, v in (("dtype", args.dtype), ("mode", args.mode), ("plot", args.plot)) if v]
    others += [] if args.compile else ["--no-compile"]
    if others:
        print(f"opforge bench {NAME}: {', '.join(others)} {'does' if len(others) == 1 else 'do'} not apply to it")
        return 2
    if args.from_json:
        if args.json or len(args.ops) > 1 or args.quick or args.device or own_options_given(args):
            print(
                f"opforge bench {NAME}: --from-json redraws a saved run; it takes no OPS, --json, --device, "
                "--quick, --calls, --repeats or --threads"
            )
            return 2
        import json
        from pathlib import Path

        result = overhead_report.from_json(json.loads(Path(args.from_json).read_text()))
    else:
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device == "cuda" and not torch.cuda.is_available():
            print(f"opforge bench {NAME}: --device cuda, but torch sees no CUDA GPU")
            return 2
        only = tuple(args.ops[1:])
        if not overhead.select(only):
            print(
                f"opforge bench {NAME}: no op matches {' '.join(only)}; ops: "
                f"{', '.join(c.op for c in overhead.select(()))}"
            )
            return 2
        if args.threads:
            torch.set_num_threads(args.threads)
        settings = overhead.Settings(
            device=device,
            calls=args.calls or (overhead.QUICK_CALLS if args.quick else overhead.CALLS),
            repeats=args.repeats or (overhead.QUICK_REPEATS if args.quick else overhead.REPEATS),
            quick=args.quick,
        )
        result = overhead.run(settings, progress=args.progress, only=only)
    print(overhead_report.table(result))
    for path, write in ((args.json, overhead_report.write_json), (args.markdown, overhead_report.write_markdown)):
        if path:
            write(result, path)
            print(f"wrote {path}")
    return 1 if any(r.status != "ok" for r in result.rows) else 0
