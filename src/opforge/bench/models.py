"""``opforge bench models``: whole torchvision models, end to end, opforge against what users pick.

Per cell (model, device, dtype, batch, memory format, inference or one
training step) the providers run side by side in one process:

- ``eager``: the model as built (``weights=None``, BatchNorm statistics
  randomized so folding is exercised on real numbers);
- ``compile``: ``torch.compile(model)``;
- ``compile_freezing``: the same with ``torch._inductor.config.freezing``
  (inference only: it folds conv + BatchNorm too);
- ``optimize``: ``opforge.optimize(model, example_inputs=...)``;
- ``compile_optimize``: ``torch.compile(opforge.optimize(model))``;
- on CUDA also ``compile_ro`` / ``compile_optimize_ro``: ``mode="reduce-overhead"``.

Each provider's output is first compared with the eager float32 model on the
same input (max relative error, reported); then they are timed together: a
warm-up each, then ``repeats`` rounds in which every provider runs one loop
of ``calls`` calls in turn, the device synchronised around each loop; the
median loop time per call is reported in milliseconds (each round's in the
JSON, ``rounds_ms``). Taking turns keeps a host whose speed drifts during
the cell from favouring whichever provider ran first. A training step is
forward, ``loss = out.float().square().mean()``, backward and an SGD step
(dropout off, so that the outputs compare).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import statistics
import time
from collections.abc import Callable

import torch

from .models_spec import MODELS, PROVIDERS  # noqa: F401  (re-exported)

IMAGE = 224


@dataclasses.dataclass(frozen=True)
class Cell:
    model: str
    device: str
    dtype: str  # "float32" | "bfloat16"
    batch: int
    layout: str  # "channels_last" | "nchw"
    mode: str  # "inference" | "train"
    image: int = IMAGE  # the input's height and width


@dataclasses.dataclass
class Timed:
    ms: float | None = None  # median per call; None: not run (see status)
    max_rel_error: float | None = None
    status: str = "ok"  # ok | n/a | failed: <reason>
    optimized: str | None = None  # optimize's providers: what its report says, in a line
    # Each round's ms per call, in the order run: the spread behind the median, and whether a slow
    # spell of the host hit some rounds (or every round of a cell). None: not timed, or an older run.
    rounds_ms: list[float] | None = None


@dataclasses.dataclass
class CellResult:
    cell: Cell
    providers: dict[str, Timed]
    # The run that measured this cell (sources, date, machine): a merged table holds cells of several
    # runs. Read from a file, the cell's own entry, else the file's; None: the run being made.
    environment: dict | None = None


def providers_for(cell: Cell) -> list[str]:
    out = [p for p in PROVIDERS if cell.device == "cuda" or not p.endswith("_ro")]
    return [p for p in out if not (p == "compile_freezing" and cell.mode == "train")]


def randomized(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.copy_(torch.rand(m.running_mean.shape, generator=gen) * 0.2 - 0.1)
            m.running_var.copy_(torch.rand(m.running_var.shape, generator=gen) * 0.5 + 0.75)
    return model


def _build(cell: Cell, seed: int) -> tuple[torch.nn.Module, torch.Tensor]:
    import torchvision

    torch.manual_seed(seed)
    model = randomized(getattr(torchvision.models, cell.model)(weights=None), seed)
    dtype = getattr(torch, cell.dtype)
    fmt = torch.channels_last if cell.layout == "channels_last" else torch.contiguous_format
    model = model.to(device=cell.device, dtype=dtype, memory_format=fmt).train(cell.mode == "train")
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.eval()  # no random masks: every provider's output compares with the reference
    x = torch.randn(cell.batch, 3, cell.image, cell.image, device=cell.device, dtype=dtype)
    x = x.contiguous(memory_format=fmt)
    return model, x


def _callable(
    provider: str, model: torch.nn.Module, x: torch.Tensor, train: bool
) -> tuple[Callable[[], torch.Tensor], str | None]:
    """The provider's timed call, and for optimize's providers its report in a line (else None)."""
    import opforge

    m = copy.deepcopy(model)
    summary = None
    if provider in ("optimize", "compile_optimize", "compile_optimize_ro"):
        m, report = opforge.optimize(m, example_inputs=(x,), report=True)
        summary = report_line(report)
    if provider.startswith("compile"):
        mode = "reduce-overhead" if provider.endswith("_ro") else None
        if provider == "compile_freezing":
            # Freezing as the backend's own option: a backend equal to plain compile's (the global
            # config patched around the first call) would reuse plain compile's graph for this copy.
            compiled = torch.compile(m, options={"freezing": True})
        else:
            compiled = torch.compile(m, mode=mode)
        forward = compiled
    else:
        forward = m
    if not train:

        def infer():
            with torch.no_grad():
                return forward(x)

        return infer, summary
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)

    def step():
        out = forward(x)
        out.float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.detach()

    return step, summary


def report_line(report) -> str:
    """optimize's report in a line: how many layers changed, into what, then its model-level notes."""
    changed = f"{len(report.replaced)} of {len(report.layers)} layers changed"
    actions = collections.Counter(row.action for row in report.replaced)
    if actions:
        changed += " (" + ", ".join(f"{n}x {action}" for action, n in actions.most_common()) + ")"
    return "; ".join([changed, *report.notes])


def _max_rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    diff = (out.float().cpu() - ref.float().cpu()).abs().max().item()
    return diff / max(ref.float().abs().max().item(), 1e-30)


def _time_interleaved(fns: dict[str, Callable[[], torch.Tensor]], device: str, calls: int, repeats: int):
    """Each fn's ms per call in every round, or its failure as text. The loops take turns (round r
    times every provider once), so that a host or clock that drifts during the cell shifts every
    provider alike."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    samples: dict[str, list[float]] = {name: [] for name in fns}
    failed: dict[str, str] = {}
    for name, fn in fns.items():
        try:
            for _ in range(3):
                fn()
        except Exception as exc:
            failed[name] = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
    for _ in range(repeats):
        for name, fn in fns.items():
            if name in failed:
                continue
            try:
                sync()
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                sync()
            except Exception as exc:  # that provider is reported failed; the others go on
                failed[name] = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
                continue
            samples[name].append((time.perf_counter() - t0) / calls * 1e3)
    return {name: failed.get(name) or v for name, v in samples.items()}


def run_cell(cell: Cell, calls: int, repeats: int, seed: int = 0, only: tuple[str, ...] = ()) -> CellResult:
    model, x = _build(cell, seed)
    train = cell.mode == "train"
    # The reference: the eager model in float32 on the same input, before any training step.
    ref_model = copy.deepcopy(model).float().eval() if not train else copy.deepcopy(model).float()
    with torch.no_grad():
        torch.manual_seed(seed)
        ref = ref_model(x.float())
    result = CellResult(cell, {})
    fns, errors, summaries = {}, {}, {}
    for provider in providers_for(cell):
        if only and provider not in only:
            continue
        try:
            torch.manual_seed(seed)
            fn, summaries[provider] = _callable(provider, model, x, train)
            torch.manual_seed(seed)
            errors[provider] = _max_rel_error(fn(), ref)
            fns[provider] = fn
        except Exception as exc:  # a provider that fails is reported, the others still run
            result.providers[provider] = Timed(status=f"failed: {type(exc).__name__}: {str(exc)[:200]}")
    try:
        times = _time_interleaved(fns, cell.device, calls, repeats)
        for provider in providers_for(cell):
            if provider in fns:
                t = times[provider]
                if isinstance(t, str):
                    timed = Timed(status=t)
                else:
                    timed = Timed(statistics.median(t), errors[provider], rounds_ms=[round(v, 5) for v in t])
                result.providers[provider] = dataclasses.replace(timed, optimized=summaries[provider])
    finally:
        torch._dynamo.reset()
    return result


def cells(devices, models, dtypes, batches, layouts, modes, image: int = IMAGE) -> list[Cell]:
    out = []
    for device in devices:
        for model in models:
            for dtype in dtypes:
                if device == "cpu" and dtype != "float32":
                    continue
                for batch in batches:
                    for layout in layouts:
                        for mode in modes:
                            out.append(Cell(model, device, dtype, batch, layout, mode, image))
    return out
