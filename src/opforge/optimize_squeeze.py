"""Squeeze-and-excitation blocks in ``opforge.optimize``: each becomes one op call where that is faster.

A block is torchvision's ``SqueezeExcitation`` (the class itself: a subclass
may compute something else) whose parts the op computes
(``nn_squeeze_excitation.why_not_fusable``). With
``example_inputs``, it is timed against the block on the input it saw in the
example run (a forward in eval mode, a forward and a backward in training:
the op's gradients are autograd's through its ATen ops, the same as the
block's) and replaced where the op is faster; ``force=True`` replaces every
such block untimed.
"""

from __future__ import annotations

import torch

from .nn_squeeze_excitation import SqueezeExcitation, why_not_fusable
from .optimize_blocks import has_hooks
from .optimize_choice import _MARGIN, _cache, _layout, _median_us, _run
from .optimize_patterns import set_submodule
from .optimize_report import LayerReport

PATTERN = "SqueezeExcitation (avgpool -> fc1 -> activation -> fc2 -> scale_activation -> mul)"


def is_squeeze_block(m: torch.nn.Module) -> bool:
    cls = type(m)
    return cls.__name__ == "SqueezeExcitation" and cls.__module__.startswith("torchvision.")


def find_squeeze_blocks(model: torch.nn.Module) -> list[str]:
    """The qualified names of the model's squeeze-and-excitation blocks (each used once)."""
    counts: dict[int, int] = {}
    for _, m in model.named_modules(remove_duplicate=False):
        counts[id(m)] = counts.get(id(m), 0) + 1
    return [name for name, m in model.named_modules() if name and is_squeeze_block(m) and counts[id(m)] == 1]


def _faster(block: torch.nn.Module, fused: SqueezeExcitation, x: torch.Tensor) -> tuple[bool, str]:
    """Whether the op beats the block on ``x`` by the margin, and the times; cached per shape and mode.
    In training mode both are timed as a forward and a backward (``optimize_choice._run``)."""
    training = block.training
    key = ("squeeze", str(x.device), x.dtype, _layout(x), tuple(x.shape), tuple(fused.fc1.weight.shape))
    key += (fused.activation_name, fused.scale_activation_name, training)
    if key not in _cache:
        theirs = _median_us(lambda: _run((block,), None, x, training), x.device)
        ours = _median_us(lambda: _run((fused,), None, x, training), x.device)
        win = ours * _MARGIN <= theirs
        what = "forward + backward" if training else "forward"
        _cache[key] = (win, f"measured {ours:.1f} us vs {theirs:.1f} us for the block's modules, {what}")
    return _cache[key]


def apply_squeeze_blocks(
    model: torch.nn.Module, inputs: dict[str, tuple], measured: bool, force: bool
) -> list[LayerReport]:
    """Replace the blocks found in ``model`` (see the module's docs); a report row per block."""
    rows = []
    for name in find_squeeze_blocks(model):
        block = model.get_submodule(name)
        why = why_not_fusable(block)
        if not why and any(has_hooks(m) for m in block.modules()):
            why = "the block or one of its parts has hooks, which one op call would not run"
        if why:
            rows.append(LayerReport(name, PATTERN, "left", why))
            continue
        fused = SqueezeExcitation.from_module(block)
        if block.training:
            # The block's own Parameter objects, not copies: an optimizer built on the model before
            # optimize(..., inplace=True) keeps stepping them (as ConvCandidate.module does).
            for mine, theirs in ((fused.fc1, block.fc1), (fused.fc2, block.fc2)):
                mine.weight = theirs.weight
                if theirs.bias is not None:
                    mine.bias = theirs.bias
        if force:
            reason = "force=True: not timed"
        elif not measured:
            rows.append(LayerReport(name, PATTERN, "left", "pass example_inputs to time the op on this block"))
            continue
        elif name not in inputs:
            rows.append(LayerReport(name, PATTERN, "left", "not called by example_inputs"))
            continue
        else:
            win, reason = _faster(block, fused, inputs[name][0])
            if not win:
                rows.append(LayerReport(name, PATTERN, "left", reason))
                continue
        set_submodule(model, name, fused)
        rows.append(LayerReport(name, PATTERN, "one opforge.squeeze_excitation call", reason))
    return rows
