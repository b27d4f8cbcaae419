"""The part of a model that takes its NCHW batch, where the model itself does not.

A detection model is called with a list of images; its transform resizes
and batches them into one NCHW tensor, which its backbone takes. The
layout choice (``optimize_layout``) looks at the model's own inputs, so
such a backbone was optimized in NCHW only. ``optimize`` therefore also
optimizes that part as a model of its own (its layout chosen, both ways
where it keeps NCHW) and keeps it where it times 3% faster than the part
as optimized inside the whole model, with the same outputs.
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from .optimize_layout import _is_nchw_batch, _nchw_batches, faster_layout, has_channels_last_hooks


@dataclasses.dataclass
class Part:
    name: str  # qualified name in the model
    batch: torch.Tensor  # its input in the example run
    original: torch.nn.Module  # a copy, taken before any of its layers is replaced


def find_part(model: torch.nn.Module, example_inputs: tuple) -> Part | None:
    """The submodule ``optimize`` also treats as a model of its own, or None: for an eval-mode
    model whose inputs hold no NCHW batch, the outermost submodule called once with one NCHW batch
    as its only argument; of several, the one holding the most convs (the backbone, not a box
    head's MLP)."""
    if model.training or _nchw_batches(example_inputs):
        return None
    calls: dict[str, int] = {}
    batches: dict[str, torch.Tensor] = {}

    def hook(module, args, kwargs, name):
        calls[name] = calls.get(name, 0) + 1
        if calls[name] == 1 and not kwargs and len(args) == 1 and _is_nchw_batch(args[0]):
            batches[name] = args[0].detach()

    handles = [
        m.register_forward_pre_hook(lambda m, a, k, name=name: hook(m, a, k, name), with_kwargs=True)
        for name, m in model.named_modules()
        if name
    ]
    try:
        with torch.no_grad():
            model(*example_inputs)
    except Exception:  # noqa: BLE001 - the model's own error surfaces where the caller runs it
        return None
    finally:
        for h in handles:
            h.remove()
    named = {name: batch for name, batch in batches.items() if calls[name] == 1}
    outermost = [n for n in named if not any(n.startswith(other + ".") for other in named)]
    convs = {n: sum(isinstance(m, torch.nn.Conv2d) for m in model.get_submodule(n).modules()) for n in outermost}
    if not convs or max(convs.values()) == 0:
        return None
    name = max(outermost, key=lambda n: convs[n])
    try:
        original = copy.deepcopy(model.get_submodule(name))
    except Exception:  # noqa: BLE001 - e.g. a lock among its attributes: optimized inside only
        return None
    return Part(name, named[name], original)


def optimize_alone(part: Part, optimized: torch.nn.Module, optimize, layers: dict, notes: list[str]):
    """``part`` optimized as a model of its own, set into ``optimized`` where that is faster than
    the part as optimized inside it: the report's rows (``layers``, in place) and ``notes`` follow."""
    try:
        alone, report = optimize(part.original, example_inputs=(part.batch,), report=True)
    except Exception as e:  # noqa: BLE001 - e.g. out of memory: the part stays as optimized inside
        notes.append(f"{part.name}: optimized as a model of its own, it failed ({str(e)[:80]})")
        return
    if not has_channels_last_hooks(alone):
        return  # the same layout as inside, its layers chosen on the same input: nothing to gain
    inside = optimized.get_submodule(part.name)
    take, why = faster_layout(inside, alone, (part.batch,))
    if not take:
        notes.extend([f"{part.name} (takes the model's NCHW batch), as a model of its own: {why}"] if why else [])
        return
    parent, _, attr = part.name.rpartition(".")
    setattr(optimized.get_submodule(parent) if parent else optimized, attr, alone)
    for name in [n for n in layers if n.startswith(part.name + ".")]:
        del layers[name]
    for row in report.layers:
        layers[f"{part.name}.{row.conv}"] = dataclasses.replace(row, conv=f"{part.name}.{row.conv}")
    notes.append(f"{part.name} (takes the model's NCHW batch) optimized as a model of its own: {why}")
