"""``opforge demo``: the quick benchmark, ``opforge bench --quick``.

Every registered op's quick cases against the eager PyTorch composition
users would otherwise write and against ``torch.compile`` of it, on the
GPU when one is visible, else on the CPU. The harness is
:mod:`opforge.bench.harness`; the method is in docs/bench.md.
"""

from __future__ import annotations


def run(device: str | None = None) -> int:
    """Runs the quick benchmark and prints its table; the exit status of ``opforge bench``."""
    from .bench.cli_args import demo_args, run_bench

    return run_bench(demo_args(device))
