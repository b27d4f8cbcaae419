"""What a bench run produced: settings, per-provider and per-case results, the run.

Plain data, shared by the harness that fills it and the reports that print
it; it imports nothing else of the benchmark, so neither side imports the other.
"""

from __future__ import annotations

import dataclasses

import torch

MODES = ("fwd", "bwd", "full")
PROVIDERS = ("opforge", "eager", "compiled", "peer")


@dataclasses.dataclass
class Settings:
    device: str = "cpu"
    quick: bool = False
    modes: tuple[str, ...] = MODES
    dtypes: tuple[torch.dtype, ...] | None = None  # None: every dtype a case declares
    ops: tuple[str, ...] = ()  # family or op names; () = all
    compile: bool = True  # time torch.compile(eager)


@dataclasses.dataclass
class ProviderResult:
    name: str  # display name: "opforge", "slow_add", "torch.compile(slow_add)", "torchvision.nms"
    status: str  # "ok", "WRONG", "error", "n/a"
    median_ms: float | None = None
    p20_ms: float | None = None
    p80_ms: float | None = None
    peak_mem_bytes: int | None = None  # None: not measured (CPU)
    gbps: float | None = None
    pct_floor: float | None = None
    tflops: float | None = None
    detail: str | None = None  # error or mismatch text
    host_ms: float | None = None  # GPU: host time to issue one call (not in median_ms)


@dataclasses.dataclass
class CaseResult:
    family: str
    op: str
    shape: str
    dtype: str
    mode: str
    bytes: int  # bytes this mode must move (0: not memory-bound)
    flops: float
    input_sets: int
    providers: dict[str, ProviderResult]
    copy_ms: float | None = None  # a device copy of the same bytes (memory-bound cases)

    @property
    def pct_copy(self) -> float | None:
        """opforge's time as % of a copy of the same bytes (100%: as fast as that copy)."""
        ours = self.providers.get("opforge")
        if self.copy_ms is None or ours is None or ours.median_ms is None:
            return None
        return 100.0 * self.copy_ms / ours.median_ms

    def speedup(self, other: str) -> float | None:
        ours, base = self.providers.get("opforge"), self.providers.get(other)
        if ours is None or base is None or ours.median_ms is None or base.median_ms is None:
            return None
        return base.median_ms / ours.median_ms

    @property
    def wrong(self) -> bool:
        return self.providers["opforge"].status == "WRONG"


@dataclasses.dataclass
class Run:
    settings: Settings
    environment: dict
    copy_bandwidth_gbps: float
    cache_bytes: int
    results: list[CaseResult]
    seconds: float = 0.0
    problems: list[str] = dataclasses.field(default_factory=list)  # families left out, and why
