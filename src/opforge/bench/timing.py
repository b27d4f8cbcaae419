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
    host_ms: float | None = None  # host time to issue one call (GPU only)

    @classmethod
    def from_samples(cls, samples_ms: list[float]) -> Timing:
        s = sorted(samples_ms)
        med = statistics.median(s)
        if len(s) < 2 or s[0] == s[-1]:
            return cls(med, med, med)
        q = statistics.quantiles(s, n=10, method="inclusive")
        # interpolation can land an ulp outside the median; keep p20 <= median <= p80
        return cls(med, min(q[1], med), max(q[7], med))


_SPIN_CYCLES_PER_MS: list[float] = []


def _spin_cycles_per_ms() -> float:
    """Clock cycles of ``torch.cuda._sleep`` per millisecond, measured once."""
    if not _SPIN_CYCLES_PER_MS:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1000)  # loads the spin kernel
        start.record()
        torch.cuda._sleep(2_000_000)
        end.record()
        torch.cuda.synchronize()
        _SPIN_CYCLES_PER_MS.append(2_000_000 / max(start.elapsed_time(end), 1e-3))
    return _SPIN_CYCLES_PER_MS[0]


def time_cuda(fn, *, warmup_ms: float = 25.0, rep_ms: float = 100.0, min_reps: int = 10) -> Timing:
    """Median of per-call CUDA-event timings of the GPU's own work.

    Before each timed call a spin kernel (``torch.cuda._sleep``) is queued,
    long enough for the host to queue the start event, the call and the end
    event behind it: the events then bracket the call's kernels back to back,
    not the host's time to reach them (the role of nvbench's blocking kernel
    and of the cache flush in triton's ``do_bench``). Host overhead per call
    is measured apart (``host_ms`` in the JSON).
    """
    import time

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
    torch.cuda.synchronize()
    # Host time of one call, while the GPU is kept busy so launches never wait.
    torch.cuda._sleep(int(_spin_cycles_per_ms() * 20))
    t0 = time.perf_counter()
    for _ in range(10):
        start.record()
        fn()
        end.record()
    host_ms = (time.perf_counter() - t0) * 1e3 / 10
    torch.cuda.synchronize()
    lead_cycles = int(_spin_cycles_per_ms() * max(0.02, 3 * host_ms))
    reps = max(min_reps, int(rep_ms / (est + 3 * host_ms)))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        torch.cuda._sleep(lead_cycles)
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    t = Timing.from_samples([s.elapsed_time(e) for s, e in zip(starts, ends)])
    t.host_ms = host_ms
    return t


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
        return (
            f"CUDA events per call behind a spin kernel (device time), {CUDA_REP_MS[quick]:g} ms of reps"
            " after 25 ms of warm-up"
        )
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
