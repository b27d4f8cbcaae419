"""Runs bench cases: correctness first, then timing of every provider.

For each case (see :mod:`opforge.bench.registry`) and each mode the harness

1. builds the providers: ``opforge`` (``case.ours``), ``eager``
   (``case.eager``, the composition users would otherwise write),
   ``compiled`` (``torch.compile(case.eager)``; a compile error is recorded
   and the run goes on) and ``peer`` (``case.peer``, when the case has one);
2. checks every provider against eager on fresh inputs: forward outputs and,
   in the ``bwd``/``full`` modes, the input gradients, with the case's
   ``compare`` or the per-dtype tolerance. A provider that disagrees is
   reported ``WRONG`` and is never timed;
3. times each provider that passed: CUDA events on the GPU, torch.utils.benchmark
   on the CPU (see :mod:`opforge.bench.timing`), median with p20/p80, cycling
   through several input sets when one set is smaller than 4x the last-level
   cache, so no provider is timed out of a warm cache;
4. records the peak memory each provider allocates for one call (GPU only);
5. derives GB/s and % of the floor (the case's bytes over the device-copy
   bandwidth measured in the same run) or TFLOP/s;
6. for memory-bound cases on the GPU, times a device copy moving the same
   bytes (half read, half written, buffers rotated past the cache as the
   inputs are): the practical ceiling at that size, where launch and ramp-up
   cost what a 1 GiB copy amortises (% of copy = that copy's time / opforge's).

Modes:

- ``fwd``: the forward call with autograd off (no input requires grad).
- ``bwd``: the backward pass alone. Each input set's forward graph is built
  once and kept (``retain_graph=True``); one rep is
  ``torch.autograd.grad(out, inputs, grad, retain_graph=True)``. This runs
  exactly the kernels a ``.backward(grad)`` on a fresh graph runs (minus
  accumulation into ``.grad``), and avoids estimating it as ``full - fwd``,
  a difference of two noisy medians.
- ``full``: forward with autograd on, then backward, on a fresh graph each
  rep: ``torch.autograd.grad(f(*inputs), inputs, grad)``.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence

import torch

from . import timing
from .case import BenchCase
from .machine import environment, last_level_cache_bytes, load_average, steady_cpu_allocator
from .registry import families
from .results import MODES, PROVIDERS, CaseResult, ProviderResult, Run, Settings

__all__ = [
    "MODES",
    "PROVIDERS",
    "TOLERANCES",
    "CaseResult",
    "ProviderResult",
    "Run",
    "Settings",
    "Progress",
    "collect_cases",
    "input_set_count",
    "known_names",
    "last_level_cache_bytes",
    "run",
    "run_case",
]

# Tolerances of the correctness check against eager, per dtype (rtol, atol).
TOLERANCES = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1.6e-2, 1e-2),
}

# Cap on the number of input sets a case cycles through.
MAX_INPUT_SETS = 32


# ---------------------------------------------------------------------------
# Helpers


def _tensors(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    return []


def _nbytes(inputs: Sequence) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(list(inputs)))


def _check_close(got, want, dtype: torch.dtype, case: BenchCase, what: str, atol: float | None = None) -> None:
    got_t, want_t = _tensors(got), _tensors(want)
    if len(got_t) != len(want_t):
        raise AssertionError(f"{what}: {len(got_t)} tensors, eager gives {len(want_t)}")
    rtol, default_atol = TOLERANCES.get(dtype, (1e-5, 1e-5))
    rtol = case.rtol if case.rtol is not None else rtol
    if atol is None:
        atol = case.atol if case.atol is not None else default_atol
    for i, (g, w) in enumerate(zip(got_t, want_t)):
        if g.shape != w.shape:
            raise AssertionError(f"{what}[{i}]: shape {tuple(g.shape)}, eager gives {tuple(w.shape)}")
        if g.is_floating_point() or w.is_floating_point():
            # NaN never passes (equal_nan=False); a NaN in both is still a failure
            # unless the case supplies its own compare.
            _assert_close_chunked(g, w, rtol, atol, f"{what}[{i}]")
        elif not torch.equal(g, w):
            raise AssertionError(f"{what}[{i}]: integer outputs differ from eager")


# Elements compared at a time: torch.testing on a 2^31-element tensor fails
# inside its own kernels, and float64 copies of it would take 32 GB.
_COMPARE_CHUNK = 1 << 26


def _assert_close_chunked(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float, what: str) -> None:
    g, w = got.reshape(-1), want.reshape(-1)
    for start in range(0, max(g.numel(), 1), _COMPARE_CHUNK):
        gs, ws = g[start : start + _COMPARE_CHUNK], w[start : start + _COMPARE_CHUNK]
        where = f" (elements {start}..{start + gs.numel() - 1} of {g.numel()})" if g.numel() > _COMPARE_CHUNK else ""
        torch.testing.assert_close(
            gs.double(),
            ws.double(),
            rtol=rtol,
            atol=atol,
            equal_nan=False,
            msg=lambda m, where=where: f"{what}{where}: {m}",
        )


def _grad_inputs(case: BenchCase, inputs: Sequence) -> list[torch.Tensor]:
    return [inputs[i] for i in case.grad_inputs]


def _prepare_inputs(case: BenchCase, mode: str) -> list:
    inputs = list(case.make_inputs())
    if mode != "fwd":
        for i in case.grad_inputs:
            inputs[i] = inputs[i].detach().requires_grad_(True)
    return inputs


def _differentiable(out) -> list[torch.Tensor]:
    """The outputs that require grad, in the order incoming gradients follow."""
    return [t for t in _tensors(out) if t.requires_grad]


def _out_grads(out) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The differentiable outputs and a random incoming gradient for each."""
    outs = _differentiable(out)
    return outs, [torch.randn_like(t) for t in outs]


def _forward_and_grads(fn, case: BenchCase, inputs: list, grads_seed: list | None = None):
    """Forward + input gradients (for the correctness check of bwd/full modes)."""
    out = fn(*inputs)
    outs = _differentiable(out)
    if not outs:
        raise AssertionError("output does not require grad")
    if grads_seed is None:
        # Drawn in the case's dtype: a float64 reference then gets exactly the
        # incoming gradient the provider gets (a float64 draw rounded for the
        # provider would differ by that rounding, summed over the kernel).
        draw = case.dtype if case.dtype.is_floating_point else None
        grads = [torch.randn_like(t, dtype=draw or t.dtype).to(t.dtype) for t in outs]
    else:  # the same incoming gradients, in each output's dtype (a float64 reference's may differ)
        grads = [g.to(t.dtype) for g, t in zip(grads_seed, outs)]
    gin = torch.autograd.grad(outs, _grad_inputs(case, inputs), grads, allow_unused=True)
    return out, list(gin), grads


def _clone_inputs(inputs: list) -> list:
    return [t.detach().clone().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t for t in inputs]


def _check_provider(fn, case: BenchCase, mode: str, reference_fn) -> None:
    """Raises AssertionError if ``fn`` disagrees with eager on fresh inputs."""
    inputs = _prepare_inputs(case, mode)
    if mode == "fwd":
        with torch.no_grad():
            got = fn(*_clone_inputs(inputs))
            want = reference_fn(*_clone_inputs(inputs))
        if case.compare is not None:
            case.compare(got, want)
        else:
            _check_close(got, want, case.dtype, case, "output")
        return
    want_out, want_grads, seed = _forward_and_grads(reference_fn, case, _clone_inputs(inputs))
    got_out, got_grads, _ = _forward_and_grads(fn, case, _clone_inputs(inputs), seed)
    if case.relu_output:
        agree = [(g > 0) == (w.to(g.dtype) > 0) for g, w in zip(_differentiable(got_out), _differentiable(want_out))]
        if not all(bool(a.all()) for a in agree):
            seed = [s * a.to(s.dtype) for s, a in zip(seed, agree)]
            want_out, want_grads, _ = _forward_and_grads(reference_fn, case, _clone_inputs(inputs), seed)
            got_out, got_grads, _ = _forward_and_grads(fn, case, _clone_inputs(inputs), seed)
    if case.compare is not None:
        case.compare(got_out, want_out)
    else:
        _check_close(got_out, want_out, case.dtype, case, "output")
    for i, (g, w) in enumerate(zip(got_grads, want_grads)):
        if (g is None) != (w is None):
            raise AssertionError(f"grad of input {case.grad_inputs[i]}: one provider gives none")
        if g is not None:
            idx = case.grad_inputs[i]
            _check_close(g, w, case.dtype, case, f"grad of input {idx}", atol=case.grad_atol.get(idx))


def input_set_count(nbytes: int, cache_bytes: int) -> int:
    """How many sets of ``nbytes`` to cycle through so that together they span
    4x the last-level cache (one when a set alone does), at most MAX_INPUT_SETS."""
    nbytes = max(nbytes, 1)
    return 1 if nbytes >= 4 * cache_bytes else min(MAX_INPUT_SETS, math.ceil(4 * cache_bytes / nbytes))


def _input_sets(case: BenchCase, mode: str, cache_bytes: int) -> list[list]:
    """One input set, or several when one is smaller than 4x the last-level cache."""
    first = _prepare_inputs(case, mode)
    count = input_set_count(max(_nbytes(first), case.bytes_fwd), cache_bytes)
    return [first] + [_prepare_inputs(case, mode) for _ in range(count - 1)]


def _timed_callable(fn, case: BenchCase, mode: str, sets: list[list]) -> Callable[[], None]:
    """A no-argument function that runs one rep of ``mode``, cycling through ``sets``."""
    n = len(sets)
    state = [0]
    if mode == "fwd":

        def call():
            i = state[0] = (state[0] + 1) % n
            fn(*sets[i])

        return call
    if mode == "full":
        # the incoming gradients are made before timing, from one untimed forward per set
        prepared = [(s, _grad_inputs(case, s), _out_grads(fn(*s))[1]) for s in sets]

        def call():
            i = state[0] = (state[0] + 1) % n
            s, gin, seeds = prepared[i]
            torch.autograd.grad(_differentiable(fn(*s)), gin, seeds, allow_unused=True)

        return call
    # bwd: one retained graph per input set
    graphs = []
    for s in sets:
        outs, grads = _out_grads(fn(*s))
        graphs.append((outs, _grad_inputs(case, s), grads))

    def call():
        i = state[0] = (state[0] + 1) % n
        outs, gin, grads = graphs[i]
        torch.autograd.grad(outs, gin, grads, retain_graph=True, allow_unused=True)

    return call


def _peak_memory(call: Callable[[], None], device: str) -> int | None:
    if device != "cuda":
        return None  # no allocator statistics for the CPU; see docs/bench.md
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    call()
    torch.cuda.synchronize()
    return max(0, torch.cuda.max_memory_allocated() - base)


def _short_error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    return first[:300]


# ---------------------------------------------------------------------------
# Running


def collect_cases(settings: Settings, problems: list[str] | None = None) -> list[tuple[str, BenchCase]]:
    """(family, case) pairs selected by the settings.

    A family whose cases cannot be built (say, its peer library is missing) is
    left out and named in ``problems``; the others still run.
    """
    out = []
    for family, make in sorted(families().items()):
        try:
            cases = make(settings.device)
        except Exception as exc:  # noqa: BLE001
            if problems is not None:
                problems.append(f"{family}: cases could not be built: {_short_error(exc)}")
            continue
        for case in cases:
            if settings.ops and family not in settings.ops and case.op not in settings.ops:
                continue
            if settings.quick and not case.quick:
                continue
            if settings.dtypes is not None and case.dtype not in settings.dtypes:
                continue
            out.append((family, case))
    return out


def known_names(device: str = "cpu") -> set[str]:
    """Every family and op name ``opforge bench OPS`` accepts."""
    names = set()
    for family, make in families().items():
        names.add(family)
        try:
            names.update(c.op for c in make(device))
        except Exception:  # noqa: BLE001  (reported by the run itself)
            pass
    return names


def _modes_for(case: BenchCase, settings: Settings) -> list[str]:
    return [m for m in settings.modes if m == "fwd" or case.grad_inputs]


def _metrics(res: ProviderResult, nbytes: int, flops: float, bandwidth: float) -> None:
    if res.median_ms is None:
        return
    seconds = res.median_ms * 1e-3
    if nbytes:
        res.gbps = nbytes / seconds / 1e9
        res.pct_floor = 100.0 * res.gbps / bandwidth if bandwidth else None
    if flops:
        res.tflops = flops / seconds / 1e12


def run_case(
    family: str, case: BenchCase, mode: str, settings: Settings, bandwidth: float, cache_bytes: int
) -> CaseResult:
    providers: dict[str, tuple[str, Callable | None, str | None]] = {
        "opforge": ("opforge", case.ours, None),
        "eager": (case.eager_name, case.eager, None),
    }
    if settings.compile and case.compile:
        torch._dynamo.reset()  # a fresh compile per case: no recompile limit, no stale guards
        providers["compiled"] = (f"torch.compile({case.eager_name})", torch.compile(case.eager, dynamic=False), None)
    if case.peer is not None:
        providers["peer"] = (case.peer_name or "peer", case.peer, None)

    nbytes = {"fwd": case.bytes_fwd, "bwd": case.bytes_bwd, "full": case.bytes_fwd + case.bytes_bwd}[mode]
    flops_bwd = case.flops_bwd
    flops = {"fwd": case.flops_fwd, "bwd": flops_bwd, "full": case.flops_fwd + flops_bwd}[mode]
    results: dict[str, ProviderResult] = {}
    sets = None
    for key, (name, fn, _) in providers.items():
        res = ProviderResult(name=name, status="ok")
        results[key] = res
        with _compile_config(key, mode):
            sets = _run_provider(res, fn, case, mode, settings, sets, cache_bytes)
        _metrics(res, nbytes, flops, bandwidth)
    copy_ms = same_size_copy_ms(nbytes, settings, cache_bytes) if nbytes and settings.device == "cuda" else None
    return CaseResult(
        family=family,
        op=case.op,
        shape=case.label,
        dtype=str(case.dtype).removeprefix("torch."),
        mode=mode,
        bytes=nbytes,
        flops=flops,
        input_sets=len(sets) if sets else 0,
        providers=results,
        copy_ms=copy_ms,
    )


def same_size_copy_ms(nbytes: int, settings: Settings, cache_bytes: int) -> float | None:
    """Median time of a device copy reading nbytes / 2 and writing nbytes / 2,
    cycling through buffers like the providers' inputs so no rep starts from a
    warm cache."""
    half = max(nbytes // 2, 1)
    count = input_set_count(nbytes, cache_bytes)
    try:
        pairs = [
            (
                torch.empty(half, dtype=torch.uint8, device=settings.device).random_(),
                torch.empty(half, dtype=torch.uint8, device=settings.device),
            )
            for _ in range(count)
        ]
        state = [0]

        def call():
            i = state[0] = (state[0] + 1) % count
            pairs[i][1].copy_(pairs[i][0])

        call()
        return timing.time_fn(call, settings.device, quick=settings.quick).median_ms
    except RuntimeError:  # out of memory (torch.OutOfMemoryError): the column stays empty
        return None


def _compile_config(key: str, mode: str):
    """AOTAutograd's donated buffers forbid ``retain_graph``; the ``bwd`` mode of the
    compiled provider turns them off (they only let the backward reuse saved tensors' memory)."""
    import contextlib

    if key == "compiled" and mode == "bwd":
        from torch._functorch import config as functorch_config

        if hasattr(functorch_config, "donated_buffer"):
            return functorch_config.patch(donated_buffer=False)
    return contextlib.nullcontext()


def _run_provider(res: ProviderResult, fn, case: BenchCase, mode: str, settings: Settings, sets, cache_bytes: int):
    """Checks then times one provider, filling ``res``; returns the (shared) input sets."""
    try:
        # A float64 reference checks forward outputs; gradients, long float32
        # reductions in every provider, are compared with eager's.
        reference = case.reference if case.reference is not None and mode == "fwd" else case.eager
        _check_provider(fn, case, mode, reference)
    except AssertionError as exc:
        res.status, res.detail = "WRONG", _short_error(exc)
        return sets
    except Exception as exc:  # noqa: BLE001  (a compile or runtime error is reported, not fatal)
        _record_error(res, exc)
        return sets
    try:
        if sets is None:
            sets = _input_sets(case, mode, cache_bytes)
        grad_ctx = torch.no_grad() if mode == "fwd" else torch.enable_grad()
        with grad_ctx:
            call = _timed_callable(fn, case, mode, sets)
            call()  # warm-up outside the timer (compiles, allocator)
            t = timing.time_fn(call, settings.device, quick=settings.quick)
            res.median_ms, res.p20_ms, res.p80_ms, res.host_ms = t.median_ms, t.p20_ms, t.p80_ms, t.host_ms
            res.peak_mem_bytes = _peak_memory(call, settings.device)
        del call
    except Exception as exc:  # noqa: BLE001
        res.median_ms = res.p20_ms = res.p80_ms = res.peak_mem_bytes = None
        _record_error(res, exc)
    return sets


def _record_error(res: ProviderResult, exc: BaseException) -> None:
    res.status, res.detail = "error", _short_error(exc)
    if os.environ.get("OPFORGE_BENCH_TRACEBACK"):
        traceback.print_exc()


class Progress:
    """A one-line progress bar on stderr, shown only on a terminal and erased when done.

    Piped or logged output gets no bar at all: the table is the whole record.
    """

    def __init__(self, total: int, stream=None, enabled: bool = True):
        self.total, self.done = max(total, 1), 0
        self.stream = stream or sys.stderr
        self.enabled = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.start = time.monotonic()

    def step(self, text: str) -> None:
        if not self.enabled:
            return
        width = 24
        filled = int(width * self.done / self.total)
        bar = "#" * filled + "." * (width - filled)
        line = f"[{bar}] {self.done}/{self.total} {time.monotonic() - self.start:5.0f}s {text}"
        self.stream.write("\r\033[K" + line[:150])
        self.stream.flush()
        self.done += 1

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\r\033[K")
            self.stream.flush()


def run(settings: Settings, progress: bool = True) -> Run:
    """Runs every selected case in every selected mode."""
    if settings.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: no CUDA GPU is visible to torch")
    # torch.compile's CPU backend imports cpp_extension, which warns about
    # CUDA_HOME on a machine without a GPU: build advice, not a bench result.
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    if settings.device == "cpu":
        steady_cpu_allocator()
    began = time.monotonic()
    load_at_start = load_average()  # before this run's own threads add to it
    problems: list[str] = []
    cases = collect_cases(settings, problems)
    work = [(f, c, m) for f, c in cases for m in _modes_for(c, settings)]
    bar = Progress(len(work) + 1, enabled=progress)
    bar.step("measuring device-copy bandwidth")
    bandwidth = timing.copy_bandwidth_gbps(settings.device)
    cache_bytes = last_level_cache_bytes(settings.device)
    results = []
    for family, case, mode in work:
        bar.step(f"{case.op} {case.label} {str(case.dtype).removeprefix('torch.')} {mode}")
        results.append(run_case(family, case, mode, settings, bandwidth, cache_bytes))
        if settings.device == "cuda":
            torch.cuda.empty_cache()
    bar.close()
    return Run(
        settings=settings,
        environment=environment(settings.device, load_at_start),
        copy_bandwidth_gbps=bandwidth,
        cache_bytes=cache_bytes,
        results=results,
        seconds=time.monotonic() - began,
        problems=problems,
    )
