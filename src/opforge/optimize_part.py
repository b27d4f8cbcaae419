"""The part of a model that takes its NCHW batch, where the model itself does not.

A detection model is called with a list of images; its transform resizes
and batches them into one NCHW tensor, which its backbone takes. The
layout choice (``optimize_layout``) looks at the model's own inputs, so
such a backbone ran NCHW whatever was faster. ``optimize`` therefore makes
the same choice for that part, on the batch it gets, before any layer is
replaced: where channels_last measures faster, the part gets the hooks
(its input converted once, its 4-d outputs back to NCHW), and the whole
model's layers are then timed and replaced on the layout they will see, by
the one pass that sees every chain (a BatchNorm outside the part after its
last conv, a parent calling one of the part's layers itself).
"""

from __future__ import annotations

import functools

import torch

from .optimize_layout import _is_nchw_batch, _nchw_batches, choose_channels_last
from .optimize_patterns import run_watched


def find_part(model: torch.nn.Module, example_inputs: tuple) -> tuple[str, torch.Tensor] | None:
    """(name, its input) of the part the layout choice is made for, or None: for an eval-mode model
    whose inputs hold no NCHW batch, the outermost submodule called once with one NCHW batch as its
    only argument; of several, the one holding the most convs (the backbone, not a box head's MLP).
    The run that finds it is in eval mode throughout (``run_watched``)."""
    if model.training or _nchw_batches(example_inputs):
        return None
    calls: dict[str, int] = {}
    batches: dict[str, torch.Tensor] = {}

    def count(name, module, args, kwargs):
        calls[name] = calls.get(name, 0) + 1
        if calls[name] == 1 and not kwargs and len(args) == 1 and _is_nchw_batch(args[0]):
            batches[name] = args[0].detach()

    watch = {name: functools.partial(count, name) for name, _ in model.named_modules() if name}
    try:
        run_watched(model, example_inputs, watch)
    except Exception:  # noqa: BLE001 - a ScriptModule takes no hooks; the model's own error surfaces later
        return None
    named = {name: batch for name, batch in batches.items() if calls[name] == 1}
    outermost = [n for n in named if not any(n.startswith(other + ".") for other in named)]
    convs = {n: sum(isinstance(m, torch.nn.Conv2d) for m in model.get_submodule(n).modules()) for n in outermost}
    if not convs or max(convs.values()) == 0:
        return None
    name = max(outermost, key=lambda n: convs[n])
    return name, named[name]


def choose_part_layout(model: torch.nn.Module, example_inputs: tuple) -> list[str]:
    """The layout choice made for the part that takes the model's NCHW batch (in place, before any
    layer is replaced): the report's notes."""
    found = find_part(model, example_inputs)
    if found is None:
        return []
    name, batch = found
    _, why = choose_channels_last(model.get_submodule(name), (batch,))
    return [f"{name} (takes the model's NCHW batch): {why}"] if why else []
