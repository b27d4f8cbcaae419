"""Which engine a residual tail (``opforge.nn.ConvResidual``) runs on, measured on its own inputs;
what a training tail (``opforge.nn.ConvBatchNorm2d`` with the shortcut) runs on.

The tail replaced ``act(bn(conv(x)) + shortcut)``. Each engine that can run
it on the layer's device and dtype is timed on the inputs the layer saw in
the example run, against those original modules; the fastest engine is
taken where it beats them by the margin, else the plain ``"torch"`` engine
(the folded conv, then the add and the activation). Timings are cached per
process by everything that decides the speed.
"""

from __future__ import annotations

import torch

from .nn_conv_batch_norm import ConvBatchNorm2d
from .nn_prepacked import CUDNN_FUSED_DTYPES, onednn_runs
from .nn_residual import ONEDNN_ACTIVATIONS
from .ops.conv_batch_norm import why_not_own_engine
from .optimize_blocks import ResidualTail
from .optimize_choice import _MARGIN, _cache, _layout, _median_us
from .optimize_report import LayerReport


def engines_for(layer, x: torch.Tensor) -> list[str]:
    """The fused engines that can run ``layer`` on inputs like ``x`` (``"torch"`` always can)."""
    out = []
    if layer.activation == "relu":
        out.append("add_relu")
        if x.is_cuda and x.dtype in CUDNN_FUSED_DTYPES and torch.backends.cudnn.is_available():
            out.append("cudnn")
    if layer.activation in ONEDNN_ACTIVATIONS and x.device.type == "cpu" and onednn_runs(x.dtype):
        out.append("onednn")
    return out


def _timed_engine(layer, engine: str, x: torch.Tensor, r: torch.Tensor) -> float | None:
    """The engine's time per call in us, or None where it fails on this input."""
    layer.engine = engine
    try:
        with torch.no_grad():
            layer(x, r)
            return _median_us(lambda: layer(x, r), x.device)
    except RuntimeError:  # e.g. cuDNN has no fused plan for this shape
        return None


def choose_engine(tail: ResidualTail, layer, x: torch.Tensor, r: torch.Tensor) -> tuple[str, str]:
    """(the engine to run, the measured times as text); leaves ``layer.engine`` set to it."""
    c = tail.conv
    key = ("residual", str(x.device), x.dtype, _layout(x), tuple(x.shape), tuple(r.shape), _layout(r))
    key += (tuple(c.weight.shape), tuple(c.stride), str(c.padding), tuple(c.dilation), c.groups)
    key += (tail.bn is not None, type(tail.act).__name__)
    if key in _cache:
        engine, why = _cache[key]
        layer.engine = engine
        return engine, why

    def original():
        y = c(x)
        return tail.act((tail.bn(y) if tail.bn is not None else y) + r)

    with torch.no_grad():
        theirs = _median_us(original, x.device)
    times = {e: _timed_engine(layer, e, x, r) for e in ["torch", *engines_for(layer, x)]}
    ran = {e: t for e, t in times.items() if t is not None}
    best = min(ran, key=ran.get)
    engine = best if ran[best] * _MARGIN <= theirs or best == "torch" else "torch"
    layer.engine = engine
    timings = ", ".join(f"{e} {t:.1f} us" for e, t in ran.items())
    why = f"measured {timings} vs {theirs:.1f} us for torch's layers"
    failed = [e for e, t in times.items() if t is None]
    if failed:
        why += f"; {', '.join(failed)} cannot run this shape"
    _cache[key] = (engine, why)
    return engine, why


def training_tail_row(tail: ResidualTail, inputs: tuple | None) -> LayerReport:
    """What a training tail runs on: opforge's batch norm engine where it takes the conv output and the
    shortcut is laid out as it (seen where ``inputs`` were), else ATen's kernels in one op call."""
    done = f"conv + BatchNorm + add + {type(tail.act).__name__} as one op"
    why = "training mode: BatchNorm is not folded; one call and one autograd node"
    if inputs is None or len(inputs) != 2:
        return LayerReport(tail.name, tail.pattern, done, f"{why}, the engine picked per call")
    x, shortcut = inputs
    with torch.no_grad():
        conv_out = tail.conv(x)
    where = why_not_own_engine(conv_out, tail.bn)
    if not where and shortcut.stride() != conv_out.stride():
        where = "a shortcut laid out unlike the conv output"
    if where:
        return LayerReport(tail.name, tail.pattern, done, f"{why}; ATen's kernels here ({where})")
    return LayerReport(tail.name, tail.pattern, done, f"{why}: opforge's batch norm engine adds the shortcut")


def apply_tail(model: torch.nn.Module, tail: ResidualTail, inputs: tuple | None, measured: bool, force: bool):
    """Set the tail's engine (timed where ``inputs`` were seen) and say what was done."""
    layer = model.get_submodule(tail.name)
    if isinstance(layer, ConvBatchNorm2d):
        return training_tail_row(tail, inputs)
    folded = "BatchNorm folded, " if tail.bn is not None else ""
    done = f"{folded}shortcut add and {type(tail.act).__name__} fused into one layer"
    if force:
        engine = "add_relu" if layer.activation == "relu" else "torch"
        layer.engine = engine
        return LayerReport(tail.name, tail.pattern, f"{done}, engine {engine}", "force=True: not timed")
    if not measured:
        why = "engine torch (the add and activation as torch's ops): pass example_inputs to time the fused engines"
        return LayerReport(tail.name, tail.pattern, f"{done}, engine torch", why)
    if inputs is None or len(inputs) != 2:
        return LayerReport(tail.name, tail.pattern, f"{done}, engine torch", "not called by example_inputs")
    engine, why = choose_engine(tail, layer, *inputs)
    return LayerReport(tail.name, tail.pattern, f"{done}, engine {engine}", why)
