"""Timing primitives: CUDA events on the GPU, torch.utils.benchmark on the CPU.

Every timer warms up first and reports the median with p20/p80, in
milliseconds. Inputs larger than the cache should be rotated by the caller
(pass a function that cycles through several input sets).
"""

from __future__ import annotations

import dataclasses
import statistics

import torch


@dataclasses.dataclass
class Timing:
    median_ms: float
    p20_ms: float
    p80_ms: float

    @classmethod
    def from_samples(cls, samples_ms: list[float]) -> "Timing":
        s = sorted(samples_ms)
        med = statistics.median(s)
        if len(s) < 2 or s[0] == s[-1]:
            return cls(med, med, med)
        q = statistics.quantiles(s, n=10, method="inclusive")
        # interpolation can land an ulp outside the median; keep p20 <= median <= p80
        return cls(med, min(q[1], med), max(q[7], med))


def time_cuda(fn, *, warmup_ms: float = 25.0, rep_ms: float = 100.0, min_reps: int = 10) -> Timing:
    """Median of per-call CUDA-event timings (like triton's do_bench)."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        fn()
    end.record()
    torch.cuda.synchronize()
    est = max(start.elapsed_time(end) / 5, 1e-3)
    for _ in range(max(1, int(warmup_ms / est))):
        fn()
    reps = max(min_reps, int(rep_ms / est))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return Timing.from_samples([s.elapsed_time(e) for s, e in zip(starts, ends)])


def time_cpu(fn, *, min_run_time: float = 0.2) -> Timing:
    """torch.utils.benchmark's adaptive measurement; per-call times in ms."""
    from torch.utils import benchmark

    fn()  # warm-up (also triggers any lazy compilation)
    m = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads()).blocked_autorange(
        min_run_time=min_run_time
    )
    per_call = [t * 1e3 for t in m.times]
    return Timing.from_samples(per_call if len(per_call) > 1 else per_call * 2)


# How long each measurement runs: GPU milliseconds of reps, CPU min_run_time seconds.
CUDA_REP_MS = {False: 100.0, True: 40.0}
CPU_MIN_RUN_TIME = {False: 0.3, True: 0.1}


def describe(device: str, quick: bool = False) -> str:
    """The timer and its budget, in words (recorded with the results)."""
    if device == "cuda":
        return f"CUDA events per call, {CUDA_REP_MS[quick]:g} ms of reps after 25 ms of warm-up"
    return f"torch.utils.benchmark blocked_autorange, min_run_time {CPU_MIN_RUN_TIME[quick]:g} s"


def time_fn(fn, device: str, quick: bool = False) -> Timing:
    if device == "cuda":
        return time_cuda(fn, rep_ms=CUDA_REP_MS[quick])
    return time_cpu(fn, min_run_time=CPU_MIN_RUN_TIME[quick])


def copy_bandwidth_gbps(device: str, nbytes: int | None = None) -> float:
    """Measured device-copy bandwidth (bytes read + bytes written per second).

    This is the memory ceiling every memory-bound case is compared against.
    """
    if nbytes is None:
        nbytes = (1 << 30) if device == "cuda" else (256 << 20)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    t = time_fn(lambda: dst.copy_(src), device)
    return 2 * nbytes / (t.median_ms * 1e-3) / 1e9
