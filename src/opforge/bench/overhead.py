"""``opforge bench overhead``: the host's cost of one call of every op on a tiny input.

For each op of :mod:`opforge.bench.overhead_cases`, with inputs that do not
and that do require grad, four providers are timed:

- ``opforge``: the public op;
- ``torch``: the torch code it replaces;
- ``floor_wrapper``: ``opforge_bench.noop``, a registered C++ op that does
  nothing, called through a Python function the way opforge's wrappers call
  their ops (the op's overload bound once, called with the arguments);
- ``floor_direct``: the same op called as ``torch.ops.opforge_bench.noop(x)``.

Method: per provider, ``repeats`` loops of ``calls`` calls after one untimed
loop of warm-up; each loop's wall time (``time.perf_counter``), with the GPU
synchronised before and after it, over ``calls`` is one sample; the median
and the p20/p80 of the samples are reported in microseconds. The providers'
loops alternate within each repeat, so a change in the machine's load
reaches all four alike. On the GPU a tiny kernel takes less time than the
host takes to launch it, so the loop's time is the host's.

Autograd stays on in both variants (as in an eager forward); in the "with
grad" rows the case's float inputs require grad, so every call also records
its graph node, and the call's output (and with it the graph) is dropped at
once. No backward runs.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import torch

from .overhead_cases import OverheadCase
from .overhead_cases import cases as all_cases

PROVIDERS = ("opforge", "torch", "floor_wrapper", "floor_direct")

# Calls per loop and loops per provider; --quick uses the second pair.
CALLS, REPEATS = 200, 15
QUICK_CALLS, QUICK_REPEATS = 50, 5


@dataclasses.dataclass
class Settings:
    device: str = "cpu"
    calls: int = CALLS
    repeats: int = REPEATS
    quick: bool = False


@dataclasses.dataclass
class Timed:
    median_us: float
    p20_us: float
    p80_us: float


@dataclasses.dataclass
class Row:
    op: str
    shape: str
    grad: bool  # the case's float inputs require grad
    torch_name: str
    status: str  # "ok", "WRONG" (opforge disagreed with torch; nothing timed), "error"
    providers: dict[str, Timed | None]  # None: not timed (no torch code, or the status is not ok)
    detail: str | None = None

    @property
    def ratio(self) -> float | None:
        """opforge's time / torch's (below 1: opforge's call costs the host less)."""
        ours, theirs = self.providers.get("opforge"), self.providers.get("torch")
        if ours is None or theirs is None:
            return None
        return ours.median_us / theirs.median_us


@dataclasses.dataclass
class Run:
    settings: Settings
    environment: dict
    rows: list[Row]
    seconds: float = 0.0


def noop_op():
    """``torch.ops.opforge_bench.noop`` (loading opforge's kernels first)."""
    from .. import _loader

    _loader.load()
    return torch.ops.opforge_bench.noop


def make_noop_wrapper() -> Callable[[torch.Tensor], torch.Tensor]:
    """The floor op behind a Python function that calls it as opforge's wrappers call
    theirs: the overload bound once, called with the arguments."""
    op = noop_op().default  # loads the kernels

    def noop(x: torch.Tensor) -> torch.Tensor:
        return op(x)

    return noop


def _sync(device: str) -> Callable[[], None]:
    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


def loop_seconds(fn: Callable, args: list, calls: int, sync: Callable[[], None]) -> float:
    """Wall time of ``calls`` calls of ``fn(*args)`` over ``calls``, the device idle at both ends."""
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    sync()
    return (time.perf_counter() - start) / calls


def summarise(samples_s: list[float]) -> Timed:
    """Median and p20/p80 of per-call times in seconds, in microseconds."""
    us = sorted(s * 1e6 for s in samples_s)
    med = statistics.median(us)
    if len(us) < 2:
        return Timed(med, med, med)
    q = statistics.quantiles(us, n=10, method="inclusive")
    return Timed(med, min(q[1], med), max(q[7], med))


def _inputs(case: OverheadCase, device: str, grad: bool) -> list:
    inputs = list(case.make_inputs(device))
    if grad:
        for i in case.grad_inputs:
            inputs[i] = inputs[i].detach().requires_grad_(True)
    return inputs


def _check(case: OverheadCase, inputs: list) -> None:
    """Raises AssertionError when opforge's result disagrees with the torch code's."""
    ours, theirs = case.ours(*inputs), case.torch_fn(*inputs)
    if case.compare is not None:
        case.compare(ours, theirs)
    else:
        torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=1e-5, atol=1e-5)


def time_row(case: OverheadCase, grad: bool, settings: Settings) -> Row:
    """One row: the case's four providers on one input set, loops alternating per repeat."""
    inputs = _inputs(case, settings.device, grad)
    row = Row(
        op=case.op,
        shape=case.label,
        grad=grad,
        torch_name=case.torch_name,
        status="ok",
        providers=dict.fromkeys(PROVIDERS),
    )
    try:
        if case.torch_fn is not None:
            _check(case, inputs)
    except AssertionError as exc:
        row.status, row.detail = "WRONG", str(exc).splitlines()[0][:300]
        return row
    except Exception as exc:  # noqa: BLE001  (reported in the row, the run goes on)
        row.status, row.detail = "error", f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        return row
    fns = {
        "opforge": (case.ours, inputs),
        "torch": (case.torch_fn, inputs),
        "floor_wrapper": (make_noop_wrapper(), inputs[:1]),
        "floor_direct": (noop_op(), inputs[:1]),
    }
    fns = {k: v for k, v in fns.items() if v[0] is not None}
    sync = _sync(settings.device)
    for fn, args in fns.values():  # warm-up: allocator, lazy initialisation, dispatch caches
        loop_seconds(fn, args, settings.calls, sync)
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(settings.repeats):
        for key, (fn, args) in fns.items():
            samples[key].append(loop_seconds(fn, args, settings.calls, sync))
    for key, s in samples.items():
        row.providers[key] = summarise(s)
    return row


def select(only: tuple[str, ...] = ()) -> list[OverheadCase]:
    """Every case, or those whose op names start with one of ``only``."""
    return [c for c in all_cases() if not only or any(c.op.startswith(o) for o in only)]


def run(settings: Settings, progress: bool = True, only: tuple[str, ...] = ()) -> Run:
    """Every selected case (see :func:`select`), without then with grad."""
    from .harness import Progress
    from .machine import environment, load_average

    if settings.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: no CUDA GPU is visible to torch")
    began = time.monotonic()
    load_at_start = load_average()
    work = [(c, g) for c in select(only) for g in (False, True)]
    bar = Progress(len(work), enabled=progress)
    rows = []
    for case, grad in work:
        bar.step(f"{case.op} {'with' if grad else 'without'} grad")
        rows.append(time_row(case, grad, settings))
    bar.close()
    return Run(
        settings=settings,
        environment=environment(settings.device, load_at_start),
        rows=rows,
        seconds=time.monotonic() - began,
    )
