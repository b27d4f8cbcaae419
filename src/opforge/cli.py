"""The ``opforge`` command: ``info``, ``bench``, ``demo``, ``cache``, ``new``, ``doctor``, ``ptxas``, ``deploy``.

Run it as ``opforge ...`` (installed) or ``python -m opforge ...``. Importing
this module imports neither torch nor opforge's kernels: ``cache``, ``doctor``,
``new`` and ``ptxas`` work when the kernels are missing or broken (that is when
they are needed most), and the other commands load them when they run.
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


def _cmd_new(args) -> int:
    from . import scaffold

    try:
        dest = scaffold.create(args.name, args.dir, args.kind, op=args.op, inputs=args.inputs, outputs=args.outputs)
    except scaffold.ScaffoldError as exc:
        print(f"opforge new: {exc}", file=sys.stderr)
        return 2
    print(scaffold.next_steps(dest, args.name))
    return 0


def _cmd_doctor(args) -> int:
    from . import doctor

    return doctor.main(check_kernels=not args.no_kernels)


def _cmd_ptxas(args) -> int:
    from . import ptxas_report

    return ptxas_report.main(args.files, log=args.log, arch=args.arch, includes=args.include)


def _cmd_deploy(args) -> int:
    from . import deploy

    return deploy.main(args.script, args.out, dynamic_batch=not args.static_batch, runner=args.runner)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="opforge", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="versions, build, registered ops, JIT cache, GPU")
    p.set_defaults(func=_cmd_info)

    p = sub.add_parser("cache", help="opforge's JIT build cache")
    p.add_argument("action", choices=["clear", "path"], help="clear: remove it; path: print where it is")
    p.set_defaults(func=_cmd_cache)

    p = sub.add_parser("new", help="create a standalone extension project for your own op")
    p.add_argument("name", help="package and torch namespace of the new project (a Python identifier)")
    p.add_argument("--dir", default=None, help="where to create it (default: ./NAME); must be empty or absent")
    p.add_argument(
        "--kind",
        choices=["elementwise", "rowwise", "blank"],
        default="elementwise",
        help="elementwise: relu of the sum of broadcast inputs, fused (default op add_relu, inputs a,b); "
        "rowwise: softmax over the last dim (softmax, x); blank: everything but the kernel bodies (my_op, x)",
    )
    p.add_argument("--op", default=None, help="the op's name (a lowercase identifier; default per --kind)")
    p.add_argument("--inputs", default=None, help="its tensor inputs, comma-separated, e.g. x,bias")
    p.add_argument("--outputs", default=None, help="its output's name (default out)")
    p.set_defaults(func=_cmd_new)

    p = sub.add_parser("doctor", help="check the toolchain a build needs and say how to fix what is missing")
    p.add_argument("--no-kernels", action="store_true", help="skip loading opforge's kernels (in a subprocess)")
    p.set_defaults(func=_cmd_doctor)

    p = sub.add_parser("ptxas", help="registers and spills of CUDA kernels (ptxas -v); exit 1 if any spills")
    p.add_argument("files", nargs="*", help=".cu files to compile (default: every CUDA source of opforge)")
    p.add_argument("--log", help="read a build log made with OPFORGE_PTXAS_VERBOSE=1 instead of compiling")
    p.add_argument("--arch", default="90", help="compute capability to compile for, e.g. 90 (default) or 80")
    p.add_argument("--include", "-I", action="append", default=[], help="another include folder (repeatable)")
    p.set_defaults(func=_cmd_ptxas)

    p = sub.add_parser(
        "deploy",
        help="export a model to an AOTInductor package that the C++ runner (cpp/runner) runs without Python",
    )
    p.add_argument("script", help="a Python file defining `model` and `example_inputs` (see docs/deploy.md)")
    p.add_argument("--out", default="deploy", help="folder for model.pt2, input.pt, expected.pt (default ./deploy)")
    p.add_argument("--static-batch", action="store_true", help="export the example's batch size only")
    p.add_argument("--runner", action="store_true", help="also build the C++ runner (build/runner/)")
    p.set_defaults(func=_cmd_deploy)

    from .bench.cli_args import add_parsers as add_bench_parsers

    add_bench_parsers(sub)  # `bench` and `demo` (= `bench --quick`)
    return parser


# torch.utils.benchmark and torch.compile import torch.utils.cpp_extension;
# imported first through opforge, it takes opforge's CUDA_HOME and stays quiet.
_IMPORTS_CPP_EXTENSION = {"bench", "demo", "deploy"}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in _IMPORTS_CPP_EXTENSION:
        from ._cpp_extension import import_cpp_extension

        import_cpp_extension()
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
