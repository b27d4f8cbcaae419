"""The ``opforge`` command: ``info``, ``bench``, ``demo``, ``cache``.

Run it as ``opforge ...`` (installed) or ``python -m opforge_cli ...``.
"""

from __future__ import annotations

import argparse
import sys


def _cmd_info(args) -> int:
    from . import info

    print(info.report())
    return 0


def _cmd_cache(args) -> int:
    from . import jit

    if args.action == "clear":
        removed = jit.clear_cache()
        print(f"removed {removed}" if removed else f"nothing to remove at {jit.cache_dir()}")
    else:
        print(jit.cache_dir())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="opforge", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="versions, build, registered ops, JIT cache, GPU")
    p.set_defaults(func=_cmd_info)

    p = sub.add_parser("cache", help="opforge's JIT build cache")
    p.add_argument("action", choices=["clear", "path"], help="clear: remove it; path: print where it is")
    p.set_defaults(func=_cmd_cache)

    from .bench.cli_args import add_parsers as add_bench_parsers

    add_bench_parsers(sub)  # `bench` and `demo` (= `bench --quick`)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
