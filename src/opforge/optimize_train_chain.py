"""Training-mode ``Conv2d -> BatchNorm2d [-> activation]`` chains: what ``opforge.optimize`` runs them as.

Nothing is folded in training (it would change the numerics). A chain runs
as one of:

- one ``opforge.conv2d_batch_norm`` call (``ConvBatchNorm2d``): ATen's conv,
  then opforge's batch norm + activation engine (one autograd node, the
  activation and its derivative inside the batch norm's passes);
- opforge's conv alone (``Conv2d3x3`` / ``Conv2d1x1``) with the BatchNorm and
  activation kept as modules;
- on the CPU, opforge's conv followed by the BatchNorm and activation as one
  ``opforge.batch_norm_act`` call (``BatchNormAct2d``), on the same engine;
- the modules as they are.

On CUDA the op pays wherever its engine takes the conv output (channels_last):
it saves host time and the activation's passes. On the CPU it keeps ATen's
conv while opforge's own conv can beat ATen's by more than the engine saves
(depthwise), so with ``example_inputs`` the candidates are timed forward and
backward on the layer's input and the fastest is kept.
"""

from __future__ import annotations

import copy
import types

import torch

from .nn_conv_batch_norm import BatchNormAct2d, BatchNormInConv, ConvBatchNorm2d
from .ops.conv_batch_norm import why_not_own_engine
from .optimize_blocks import has_hooks
from .optimize_choice import ConvCandidate, faster_with_opforge, training_times_us, winner
from .optimize_patterns import Chain, fusable_activation_name, set_submodule
from .optimize_report import LayerReport

_NOT_FOLDED = "training mode: BatchNorm is not folded"


def train_chain(model, chain: Chain, conv, bn, act, pattern: str, x: torch.Tensor | None) -> LayerReport:
    """A training-mode conv -> BatchNorm [-> activation]: as one ``ConvBatchNorm2d``, as opforge's
    conv alone, or left, by the rules of the module's docstring. ``x`` is the conv's input
    (``example_inputs`` given), or None: then the op is put in untimed and picks its engine per call."""
    why = _NOT_FOLDED
    if not isinstance(bn, torch.nn.BatchNorm2d):  # FrozenBatchNorm2d: folded, the conv would train another weight
        return LayerReport(chain.conv, pattern, "left", f"{why}; {type(bn).__name__} is folded in eval mode only")
    if type(conv) is not torch.nn.Conv2d or type(bn) is not torch.nn.BatchNorm2d or not bn.training:
        return LayerReport(chain.conv, pattern, "left", f"{why}; not a plain Conv2d and training BatchNorm2d")
    if bn.momentum is None:
        return LayerReport(chain.conv, pattern, "left", f"{why}; momentum=None (a cumulative average) is kept")
    if conv.padding_mode != "zeros" or isinstance(conv.padding, str):
        return LayerReport(chain.conv, pattern, "left", f"{why}; padding_mode or string padding is kept")
    how = "not timed"
    if x is not None:
        with torch.no_grad():
            conv_out = conv(x)
        where = why_not_own_engine(conv_out, bn)
        if where:
            why += (
                f"; opforge.conv2d_batch_norm would run ATen's kernels here ({where}), as the modules do, "
                "and its one call is no faster than their three"
            )
            return _conv_alone(model, chain, conv, act, pattern, x, why)
        if x.device.type == "cpu":
            return _fastest_on_cpu(model, chain, conv, bn, act, pattern, x)
        how = "opforge's batch norm engine on this channels_last conv output"
    return _install_op(model, chain, conv, bn, act, pattern, f"{why}; one call and one autograd node ({how})")


def _install_op(model, chain: Chain, conv, bn, act, pattern: str, why: str) -> LayerReport:
    act_name = fusable_activation_name(act)
    batch_norm = BatchNormInConv.of(bn)
    set_submodule(model, chain.conv, ConvBatchNorm2d.of(conv, batch_norm, act_name))
    set_submodule(model, chain.bn, batch_norm)
    action = "conv + BatchNorm" + (f" + {type(act).__name__}" if act_name else "") + " as one op"
    if act_name is not None:
        set_submodule(model, chain.act, torch.nn.Identity())
    return LayerReport(chain.conv, pattern, action, why)


def _install_conv_alone(model, chain: Chain, own: ConvCandidate, act, pattern: str, why: str) -> LayerReport:
    set_submodule(model, chain.conv, own.module())
    kept = "BatchNorm2d" + (f" and {type(act).__name__}" if act is not None else "")
    return LayerReport(chain.conv, pattern, f"{own.label} ({kept} kept)", why)


def _own_conv(conv) -> tuple[ConvCandidate | None, str]:
    """opforge's layer for the conv alone (no activation fused), or None and why not."""
    own = ConvCandidate.of(conv, None)
    if own is None:
        return None, "opforge has no kernel for this conv"
    if has_hooks(conv):
        return None, "the conv has hooks, which a new module would drop"
    return own, ""


def _conv_alone(model, chain: Chain, conv, act, pattern: str, x: torch.Tensor, why: str) -> LayerReport:
    """opforge's conv alone, the BatchNorm and activation kept as modules, where that times faster
    (forward + backward) on ``x``; else the chain is left."""
    own, why_not = _own_conv(conv)
    if own is None:
        return LayerReport(chain.conv, pattern, "left", f"{why}; {why_not}")
    win, times, _ = faster_with_opforge(own, None, x)
    if not win:
        return LayerReport(chain.conv, pattern, "left", f"{why}; the conv alone as {own.label}: {times}")
    return _install_conv_alone(model, chain, own, act, pattern, f"{why}; the conv alone: {times}")


def _fastest_on_cpu(model, chain: Chain, conv, bn, act, pattern: str, x: torch.Tensor) -> LayerReport:
    """The chain as one op, opforge's conv alone with the modules after it, opforge's conv with the
    batch norm op after it, or the modules, whichever times fastest forward and backward on ``x``
    (by the timing's margin over the modules)."""
    act_name = fusable_activation_name(act)
    own, why_not = _own_conv(conv)
    # A copy of the BatchNorm runs the timings: they must not move the model's running statistics.
    timed_bn = copy.deepcopy(bn)
    after = (act,) if act is not None else ()
    op = ConvBatchNorm2d.of(conv, BatchNormInConv.of(timed_bn), act_name)
    options = {
        "torch's layers": (conv, timed_bn) + after,
        "one op": (op,) + (after if act_name is None else ()),
    }
    if own is not None:
        options[own.label + " alone"] = (own.module(), timed_bn) + after
        options[own.label + " + batch norm op"] = (own.module(), BatchNormAct2d.of(copy.deepcopy(bn), act_name)) + (
            after if act_name is None else ()
        )
    key = types.SimpleNamespace(op="train_chain", conv=conv)
    times = training_times_us(key, act, x, options, extra=(bn.affine, bn.track_running_stats))
    best = winner(times, "torch's layers")
    measured = "forward + backward " + ", ".join(f"{name} {us:.1f} us" for name, us in times.items())
    if own is None:
        measured += f" (no conv alone: {why_not})"
    why = f"{_NOT_FOLDED}; {measured}"
    if best == "one op":
        return _install_op(model, chain, conv, bn, act, pattern, why)
    if best.endswith(" alone"):
        return _install_conv_alone(model, chain, own, act, pattern, why)
    if best.endswith(" + batch norm op"):
        set_submodule(model, chain.conv, own.module())
        set_submodule(model, chain.bn, BatchNormAct2d.of(bn, act_name))
        if act_name is not None:
            set_submodule(model, chain.act, torch.nn.Identity())
        action = f"{own.label}, BatchNorm" + (f" + {type(act).__name__}" if act_name else "") + " as one op"
        return LayerReport(chain.conv, pattern, action, why)
    return LayerReport(chain.conv, pattern, "left", why)
