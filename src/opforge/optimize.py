"""``opforge.optimize(model)``: the model with the layer patterns opforge speeds up replaced.

Patterns, found in the order the model calls its modules (a ``torch.fx``
trace, or the children of each ``nn.Sequential`` when the model does not
trace):

- ``Conv2d -> BatchNorm2d`` (eval mode): the BatchNorm is folded into the
  conv's weight and bias (any conv) and becomes ``nn.Identity``. With
  ``example_inputs`` the folded conv is timed against the pair and kept
  unless it is slower (an engine that adds the new bias as a pass of its own
  can lose what the BatchNorm's pass cost). Training mode never folds:
  there the chain ``Conv2d -> BatchNorm2d [-> activation]`` becomes one
  ``opforge.nn.ConvBatchNorm2d`` (one op call, one autograd node); with
  ``example_inputs`` only where the op's own CUDA batch norm engine takes
  the conv's output (channels_last), since elsewhere it runs the modules'
  own ATen kernels. There the conv alone may become opforge's layer (no
  activation fused), the BatchNorm and activation staying modules, where
  that times faster forward and backward on the layer's input.
- a conv opforge supports, with the activation after it (ReLU, ReLU6,
  Hardswish, SiLU; any other is left as it is): a 3x3 conv (dense or
  depthwise, stride 1 or 2, padding 0 or 1, dilation 1, zero padding) as one
  ``opforge.nn.Conv2d3x3``, a 1x1 conv (groups 1, no padding) as one
  ``opforge.nn.Conv2d1x1``, the activation fused, **only where it is
  faster** than what it replaces on the layer's own input. That is measured:
  pass ``example_inputs`` (one batch, as the model is called) and each such
  layer is timed both ways on the shape it sees; without them no conv is
  swapped, and the report says so. ``force=True`` swaps every such layer
  without timing it: the outputs are the same, the speed is not chosen (for
  checking a model's numerics under opforge's kernels, or measuring them).
- In eval mode every conv with zero padding (any kernel size, dilation,
  groups) also has ``opforge.nn.PrepackedConv2d`` as a candidate: on the CPU
  oneDNN's convolution with its weight reordered once and the activation as
  its post-op; on CUDA, where the activation is a ReLU, cuDNN's fused
  convolution + bias + ReLU. Of the candidates faster than torch's layers,
  the fastest is taken.
- Inside eval-mode blocks (``optimize_blocks``): a shared activation module
  gets a copy per call, and each ``conv [-> BatchNorm] -> add(shortcut) ->
  activation`` tail becomes one ``opforge.nn.ConvResidual`` on the engine
  that times fastest.
- torchvision's ``SqueezeExcitation`` blocks (``optimize_squeeze``): each
  becomes one ``opforge.squeeze_excitation`` call where that times faster
  (eval and training mode).
- A model called with NCHW batches (CPU or CUDA; eval or training mode)
  runs channels_last inside (``optimize_layout``: a hook converts the inputs
  once and the 4-d outputs back) where that measures faster with torch's own
  layers; an eval-mode model that kept NCHW is optimized both ways (its
  layers timed and chosen on each layout), and the channels_last one is
  kept where it times 3% faster with the same outputs. On CUDA a folded
  conv whose weight is NCHW runs as a ``PrepackedConv2d``, which hands cuDNN
  a channels_last copy of its weight made once, not per call.
- An eval-mode model whose inputs hold no NCHW batch (a detection model
  takes a list of images) has that choice made for the part that takes one
  (its backbone: ``optimize_part``), before its layers are timed.
- Under ``torch.compile`` (and export) a replaced layer is traced as
  opforge's op only where that op is also faster than what inductor makes of
  torch's conv (the conv, then its bias and activation fused into one pass);
  elsewhere it is traced as torch's conv and activation, which inductor
  fuses with their neighbours (the layer's ``torch_when_compiled``).

Last, with ``example_inputs``, the whole model is timed as optimized against
the model as it was, in its own mode (``optimize_guard``): layers that each
won alone can add up to a slower model (a host-bound step), and where the
optimized model is not 3% faster it is put back as it was (the report says so).

The result is a copy (``inplace=True`` changes ``model`` itself) of the same
type; ``report=True`` also returns an :class:`OptimizeReport` saying, layer
by layer, what was replaced and why the rest was left.
"""

from __future__ import annotations

import copy
import functools

import torch

from .optimize_blocks import restore_unchanged_blocks, rewrite_blocks, skip_identity_calls
from .optimize_choice import ConvCandidate, PrepackedCandidate, faster_under_compile, faster_with_opforge, folding_pays
from .optimize_fold import as_installed, folded_conv
from .optimize_guard import ModelState, keep_optimized
from .optimize_layout import choose_channels_last, faster_layout, install_channels_last, second_look_applies
from .optimize_part import choose_part_layout
from .optimize_patterns import (
    Chain,
    describe_conv,
    find_chains,
    fusable_activation_name,
    is_kind,
    is_opforge_layer,
    is_scripted,
    run_watched,
    set_submodule,
    uses_batch_statistics,
)
from .optimize_report import LayerReport, OptimizeReport
from .optimize_residual import apply_tail
from .optimize_squeeze import apply_squeeze_blocks, find_squeeze_blocks
from .optimize_train_chain import train_chain


def optimize(
    model: torch.nn.Module,
    *,
    example_inputs: tuple | list | torch.Tensor | None = None,
    inplace: bool = False,
    report: bool = False,
    force: bool = False,
):
    """``model`` with every pattern opforge accelerates replaced (see the module's docs).

    >>> import torch, opforge
    >>> block = torch.nn.Sequential(torch.nn.Conv2d(4, 4, 3, padding=1), torch.nn.BatchNorm2d(4)).eval()
    >>> fast = opforge.optimize(block)
    >>> x = torch.randn(1, 4, 8, 8)
    >>> torch.allclose(fast(x), block(x), atol=1e-5)
    True
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"opforge.optimize: model must be a torch.nn.Module, got {type(model).__name__}")
    if is_scripted(model):
        raise TypeError(
            "opforge.optimize: model is a TorchScript module, whose compiled code no layer can be swapped "
            "into; optimize the nn.Module, then trace (torch.jit.trace) or export (torch.export) the result"
        )
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)  # one input given bare, as torch.jit.trace takes it
    elif isinstance(example_inputs, list):
        example_inputs = tuple(example_inputs)
    elif example_inputs is not None and not isinstance(example_inputs, tuple):
        raise TypeError(
            "opforge.optimize: example_inputs must be a tuple of the model's positional inputs "
            f"(one batch, as the model is called: (x,)), got {type(example_inputs).__name__}"
        )
    out = model if inplace else copy.deepcopy(model)
    notes = []
    if example_inputs is None or force:
        layers = _replace_layers(out, example_inputs, force)
        return _finish(out, layers, notes, report)
    before = ModelState(out)
    # Before any layer is replaced: the layers are then timed on the layout they will see.
    notes += choose_part_layout(out, example_inputs)
    installed, why = choose_channels_last(out, example_inputs)
    notes += [why] if why else []
    if installed or not second_look_applies(out, why):
        layers = _replace_layers(out, example_inputs, force)
    else:
        # An eval-mode model that kept NCHW: optimized both ways, the faster whole model kept.
        out, layers, before = _both_layouts(out, before, example_inputs, inplace, notes)
    return _finish(out, _checked_whole(before, layers, example_inputs, notes), notes, report)


def _checked_whole(before: ModelState, layers: dict[str, LayerReport], example_inputs: tuple, notes: list[str]):
    """The report's rows once the optimized model is timed whole against ``before`` (the model as it
    was, put back where it is not faster: ``optimize_guard``)."""
    if not before.changed():
        return layers
    kept, why = keep_optimized(before, example_inputs)
    notes += [why] if why else []
    if kept:
        return layers
    undone = "faster alone, but the whole model was not: put back"
    return {
        name: row if row.action == "left" else LayerReport(row.conv, row.pattern, "left", f"{row.action} {undone}")
        for name, row in layers.items()
    }


def _both_layouts(out: torch.nn.Module, before: ModelState, example_inputs: tuple, inplace: bool, notes: list[str]):
    """(the optimized model, its report's rows, its state before) for an eval-mode model whose first
    choice kept NCHW: a copy optimized as NCHW and one channels_last inside, the second taken where
    ``faster_layout`` finds it faster. Where the channels_last copy cannot be made or optimized,
    NCHW stays. In place, the caller's model is then optimized the chosen way (every timing is
    cached by then)."""
    try:
        inside = copy.deepcopy(out)  # before any of out's layers is replaced
        inside_before = ModelState(inside)
        nchw = copy.deepcopy(out) if inplace else out
    except Exception as e:  # noqa: BLE001 - e.g. a lock or a handle among the model's attributes
        notes.append(f"NCHW kept: the second look optimizes a copy, and this model does not copy ({str(e)[:80]})")
        return out, _replace_layers(out, example_inputs, False), before
    nchw_layers = _replace_layers(nchw, example_inputs, False)
    try:
        install_channels_last(inside)
        inside_layers = _replace_layers(inside, example_inputs, False)
    except Exception as e:  # noqa: BLE001 - e.g. out of memory: the NCHW copy is kept, as it is optimized
        notes.append(f"NCHW kept: optimizing the model channels_last inside failed ({str(e)[:80]})")
        take_inside = False
    else:
        take_inside, why = faster_layout(nchw, inside, example_inputs)
        notes += [why] if why else []
    if not inplace:
        return (inside, inside_layers, inside_before) if take_inside else (nchw, nchw_layers, before)
    del inside, nchw, inside_before  # the copies go before the caller's model is optimized
    if take_inside:
        install_channels_last(out)
    return out, _replace_layers(out, example_inputs, False), before


def _replace_layers(out: torch.nn.Module, example_inputs: tuple | None, force: bool) -> dict[str, LayerReport]:
    """Every pattern of ``out`` replaced where it pays (in place): the report's rows by layer name."""
    measured = example_inputs is not None
    # Squeeze-and-excitation blocks first: replaced, their 1x1 convs are no chains of their own.
    blocks = find_squeeze_blocks(out)
    timed = blocks and measured and not force
    squeezes = apply_squeeze_blocks(out, _layer_inputs(out, blocks, example_inputs) if timed else {}, measured, force)
    tails, rewritten = rewrite_blocks(out)
    chains = find_chains(out)
    names = [chain.conv for chain in chains] + [tail.name for tail in tails]
    inputs = _layer_inputs(out, names, example_inputs) if example_inputs is not None and not force else {}
    layers = {c.conv: _apply(out, c, inputs.get(c.conv, (None,))[0], measured, force) for c in chains}
    layers.update(_convs_of_their_own(out, layers))
    layers.update({row.conv: row for row in squeezes})
    layers.update({t.name: apply_tail(out, t, inputs.get(t.name), measured, force) for t in tails})
    restore_unchanged_blocks(out, rewritten, [name for name, layer in layers.items() if layer.action != "left"])
    skip_identity_calls(out, rewritten)
    return layers


def _convs_of_their_own(model: torch.nn.Module, layers: dict) -> dict[str, LayerReport]:
    """Rows for the Conv2d subclasses that override its forward (no chain's part): left, and why."""
    rows = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Conv2d) and name not in layers and not is_opforge_layer(m):
            if not is_kind(m, torch.nn.Conv2d):
                why = f"{type(m).__name__} overrides Conv2d's forward: what it computes is its own"
                rows[name] = LayerReport(name, describe_conv(m), "left", why)
    return rows


def _finish(out: torch.nn.Module, layers: dict[str, LayerReport], notes: list[str], report: bool):
    """``out``, with its report where asked: the layers in the model's order."""
    if not report:
        return out
    order = {name: i for i, (name, _) in enumerate(out.named_modules())}
    ordered = [layers[name] for name in sorted(layers, key=lambda n: order.get(n, len(order)))]
    return out, OptimizeReport(ordered, notes)


def _apply(model: torch.nn.Module, chain: Chain, x: torch.Tensor | None, measured: bool, force: bool) -> LayerReport:
    conv = model.get_submodule(chain.conv)
    bn = model.get_submodule(chain.bn) if chain.bn else None
    act = model.get_submodule(chain.act) if chain.act else None
    pattern = " -> ".join([describe_conv(conv)] + [type(m).__name__ for m in (bn, act) if m is not None])
    timed = measured and x is not None and not force
    # What the layer runs as when opforge's kernel is not taken: torch's modules, the BatchNorm
    # folded into the conv where that is not slower.
    kept = (conv, bn) if bn is not None else (conv,)
    target, fold_note = conv, ""
    if bn is not None and (conv.training or uses_batch_statistics(bn)):
        return train_chain(model, chain, conv, bn, act, pattern, x if timed else None)
    if bn is not None:
        target = folded_conv(conv, bn)
        installed = as_installed(target)
        pays, why = folding_pays(conv, bn, installed, x) if timed else (True, "")
        if pays:
            kept = (installed,)
        else:
            fold_note = f"BatchNorm not folded: {why}"
    folded_kept = len(kept) == 1 and bn is not None

    def leave(reason: str) -> LayerReport:
        if folded_kept:
            set_submodule(model, chain.conv, kept[0])
            set_submodule(model, chain.bn, torch.nn.Identity())
            return LayerReport(chain.conv, pattern, "BatchNorm folded", reason)
        return LayerReport(chain.conv, pattern, "left", "; ".join(r for r in (fold_note, reason) if r))

    act_name = fusable_activation_name(act)
    # opforge's fused op where it has one; for inference also the vendor's fused conv (timed only).
    own = ConvCandidate.of(target, act_name)
    candidates = [own] + ([] if force else [PrepackedCandidate.of(target, act_name, x)])
    candidates = [c for c in candidates if c is not None]
    no_kernel = "opforge has no kernel for this conv"
    if not candidates:
        return leave(no_kernel)
    if force:
        candidate, why = candidates[0], "force=True: not timed"
    elif not measured:
        return leave("conv kept: pass example_inputs to time opforge's kernel on this layer's shape")
    elif x is None:
        return leave("not called by example_inputs")
    else:
        # Against what the layer would otherwise run: torch's conv (folded or with its BatchNorm), then
        # act. Of the candidates that win, the fastest is taken.
        results = [(c, *faster_with_opforge(c, act, x, before=kept)) for c in candidates]
        # Each timing is labelled with its candidate unless opforge's own kernel is the only one.
        labelled = len(results) > 1 or own is None
        whys = {c.op: (f"{c.label}: {why}" if labelled else why) for c, _, why, _ in results}
        wins = [(us, c) for c, win, _, us in results if win]
        if own is None:
            whys = {"none": no_kernel, **whys}
        if not wins:
            return leave("; ".join(whys.values()))
        candidate = min(wins, key=lambda t: t[0])[1]
        why = "; ".join(whys.values())
    layer = candidate.module()
    compiled_note = ""
    if isinstance(candidate, ConvCandidate) and not force and not candidate.conv.training:
        # Under torch.compile the comparison is another one: inductor fuses torch's bias and activation.
        compiled_win, compiled_why = faster_under_compile(candidate, act, x)
        layer.torch_when_compiled = not compiled_win
        why += "; " + compiled_why
        compiled_note = "" if compiled_win else "; torch's conv under torch.compile"
    set_submodule(model, chain.conv, layer)
    actions = []
    if bn is not None:
        set_submodule(model, chain.bn, torch.nn.Identity())
        actions.append("BatchNorm folded")
    if act_name is not None:
        set_submodule(model, chain.act, torch.nn.Identity())
    actions.append(candidate.label + (f" + {type(act).__name__} fused" if act_name else "") + compiled_note)
    return LayerReport(chain.conv, pattern, ", ".join(actions), why)


def _layer_inputs(model: torch.nn.Module, names: list[str], example_inputs: tuple) -> dict[str, tuple]:
    """Each named layer's positional inputs when the model runs ``example_inputs`` (in eval mode):
    of a layer's calls, the one with the largest first input (a head shared by the levels of a
    feature pyramid spends most of its time on the largest; an encoder called on two images sees
    one shape)."""
    seen: dict[str, tuple] = {}

    def size(args: tuple) -> int:
        return args[0].numel() if args and isinstance(args[0], torch.Tensor) else 0

    def keep(name, module, args, kwargs):
        if name not in seen or size(args) > size(seen[name]):
            seen[name] = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)

    run_watched(model, example_inputs, {name: functools.partial(keep, name) for name in names})
    return seen
