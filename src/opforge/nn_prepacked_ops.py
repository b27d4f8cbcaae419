"""oneDNN's prepacked convolution as one custom op, so that ``torch.compile`` keeps it.

Traced by ``torch.compile``, a :class:`~opforge.nn.PrepackedConv2d` (or a
``ConvResidual`` on its ``"onednn"`` engine) would otherwise become torch's
conv, which hands oneDNN a plain weight that it reorders on every call: the
cost the layer exists to remove. ``opforge::onednn_conv`` is opaque to
inductor: it runs oneDNN's convolution with the activation (and the
residual add) as post-ops, the weight reordered once and cached on the layer
that called it (found by the layer's id in a weak registry, so that the
cache lives and dies with the layer). ``torch.export`` still traces torch's
ops: an exported program must not need opforge's Python to run.
"""

from __future__ import annotations

import itertools
import weakref

import torch

# Layers that ran the op under torch.compile, by the id the compiled graph holds as a constant.
_LAYERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_ids = itertools.count(1)

# opforge's activation names -> oneDNN's post-op and its scalars ("none": no activation).
POST_OPS = {"none": ("none", []), "relu": ("relu", []), "relu6": ("hardtanh", [0.0, 6.0])}
POST_OPS.update({"hardswish": ("hardswish", []), "silu": ("swish", [])})


def register(layer: torch.nn.Module) -> int:
    """A new id by which the op finds ``layer``'s weight cache (a layer and each copy of it get one)."""
    layer_id = next(_ids)
    _LAYERS[layer_id] = layer
    return layer_id


def output_layout(x: torch.Tensor, weight: torch.Tensor, stride, padding, dilation) -> tuple[list[int], bool]:
    """The conv output's shape, and whether it is channels_last (as F.conv2d makes it)."""
    sizes = [x.shape[0], weight.shape[0]]
    for i in range(2):
        extent = dilation[i] * (weight.shape[2 + i] - 1) + 1
        sizes.append((x.shape[2 + i] + 2 * padding[i] - extent) // stride[i] + 1)
    return sizes, is_channels_last(x) or is_channels_last(weight)


def is_channels_last(t: torch.Tensor) -> bool:
    """t's suggested memory format is channels_last (as ATen's suggest_memory_format decides)."""
    return t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous()


def _empty(x: torch.Tensor, sizes: list[int], channels_last: bool) -> torch.Tensor:
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    return torch.empty(sizes, dtype=x.dtype, device=x.device, memory_format=fmt)


@torch.library.custom_op("opforge::onednn_conv", mutates_args=())
def onednn_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    layer: int,
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    groups: int,
    activation: str,
) -> torch.Tensor:
    """``activation(conv2d(x, weight, bias) [+ residual])`` on oneDNN, in F.conv2d's memory format."""
    owner = _LAYERS.get(layer)  # None once the layer is gone (a graph outliving it): repacked per call
    packed = owner.packed_weight(x, weight) if owner is not None else pack(weight, x, stride, padding, dilation, groups)
    if residual is None:
        attr, scalars = POST_OPS[activation]
        y = torch.ops.mkldnn._convolution_pointwise(
            x, packed, bias, padding, stride, dilation, groups, attr, scalars, ""
        )  # fmt: skip
    else:
        unary = None if activation == "none" else activation
        y = torch.ops.mkldnn._convolution_pointwise.binary(
            x, residual, packed, bias, padding, stride, dilation, groups, "add", None, unary, [], ""
        )  # fmt: skip
    sizes, channels_last = output_layout(x, weight, stride, padding, dilation)
    out = _empty(x, sizes, channels_last)
    # The strides the fake below promises (inductor checks them), size-1 dimensions included.
    return y if y.stride() == out.stride() else out.copy_(y)


@onednn_conv.register_fake
def _(x, weight, bias, residual, layer, stride, padding, dilation, groups, activation):
    return _empty(x, *output_layout(x, weight, stride, padding, dilation))


def pack(weight: torch.Tensor, x: torch.Tensor, stride, padding, dilation, groups: int) -> torch.Tensor:
    """``weight`` reordered into the blocked layout oneDNN picks for inputs shaped like ``x``."""
    return torch.ops.mkldnn._reorder_convolution_weight(
        weight.detach(), list(padding), list(stride), list(dilation), groups, list(x.shape)
    )
