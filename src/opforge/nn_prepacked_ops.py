"""oneDNN's prepacked convolution as one custom op, and the caches of prepared weights.

Traced by ``torch.compile``, a :class:`~opforge.nn.PrepackedConv2d` (or a
``ConvResidual`` on its ``"onednn"`` engine) would otherwise become torch's
conv, which hands oneDNN a plain weight that it reorders on every call: the
cost the layer exists to remove. ``opforge::onednn_conv`` is opaque to
inductor: it runs oneDNN's convolution with the activation (and the
residual add) as post-ops and the weight reordered once. ``torch.export``
still traces torch's ops: an exported program must not need opforge's
Python to run.

The reordered weights are cached by the weight tensor itself (weakly, so an
entry dies with its weight), which is the object a compiled graph passes
too: eager and compiled calls share one entry, and the graph holds no
per-layer constant that would make dynamo compile each layer apart.
"""

from __future__ import annotations

import weakref

import torch

# opforge's activation names -> oneDNN's post-op and its scalars ("none": no activation).
POST_OPS = {"none": ("none", []), "relu": ("relu", []), "relu6": ("hardtanh", [0.0, 6.0])}
POST_OPS.update({"hardswish": ("hardswish", []), "silu": ("swish", [])})


class _ByWeight:
    """One cached value per weight tensor, keyed by ``id(weight)``: these lookups run once per layer
    call, and a weak-key lookup costs microseconds, as much as some of the calls they serve. Each
    entry holds a weakref to its weight whose callback drops the entry when the weight dies, before
    its id can be reused; a lookup also checks that the weakref still points at the weight."""

    def __init__(self):
        self._entries: dict[int, tuple] = {}

    def get(self, weight: torch.Tensor):
        entry = self._entries.get(id(weight))
        return entry[1] if entry is not None and entry[0]() is weight else None

    def put(self, weight: torch.Tensor, value) -> None:
        key, entries = id(weight), self._entries
        entries[key] = (weakref.ref(weight, lambda _: entries.pop(key, None)), value)

    def drop(self, weight: torch.Tensor) -> None:
        if self.get(weight) is not None:
            del self._entries[id(weight)]


# weight -> (its data_ptr and version, [(what else the reordering depends on, the reordered weight)]),
# the latest use last: a layer called on several shapes (a head shared by the levels of a feature
# pyramid, an encoder given images of two sizes) keeps one per shape, a few at most, rather than
# reordering its weight on every call.
_PACKED = _ByWeight()
_SHAPES_PER_WEIGHT = 4


def pack(weight: torch.Tensor, x: torch.Tensor, stride, padding, dilation, groups: int) -> torch.Tensor:
    """``weight`` reordered into the blocked layout oneDNN picks for inputs shaped like ``x``."""
    return torch.ops.mkldnn._reorder_convolution_weight(
        weight.detach(), list(padding), list(stride), list(dilation), groups, list(x.shape)
    )


def packed_weight(weight: torch.Tensor, x: torch.Tensor, stride, padding, dilation, groups: int) -> torch.Tensor:
    """``pack``, cached for ``weight`` until its data or its version (bumped by every in-place
    change) changes, per input's per-sample shape and conv settings. An inference tensor has no
    version counter, so a change could not be seen: it is reordered on every call."""
    if weight.is_inference():
        return pack(weight, x, stride, padding, dilation, groups)
    # Compared, never hashed: the callers' tuples and lists are read as they are (a layer's are tuples).
    version, key = (weight.data_ptr(), weight._version), (x.shape[1:], stride, padding, dilation, groups)
    entry = _PACKED.get(weight)
    if entry is None or entry[0] != version:
        entry = (version, [])
        _PACKED.put(weight, entry)
    uses = entry[1]
    for i, (used, packed) in enumerate(uses):
        if used == key:
            if i != len(uses) - 1:
                uses.append(uses.pop(i))
            return packed
    if len(uses) == _SHAPES_PER_WEIGHT:
        del uses[0]
    uses.append((key, pack(weight, x, stride, padding, dilation, groups)))
    return uses[-1][1]


def cached(weight: torch.Tensor) -> torch.Tensor | None:
    """The reordered copy cached for ``weight`` by its latest call, if any."""
    entry = _PACKED.get(weight)
    return None if entry is None or not entry[1] else entry[1][-1][1]


# weight -> (its data_ptr, its version, its channels_last copy).
_CHANNELS_LAST = _ByWeight()


def channels_last_weight(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``weight`` as a convolution of ``x`` reads it: with a channels_last ``x``, ATen's convolution
    copies an NCHW weight into channels_last on every call (one more kernel launch per layer, the
    cost of an NCHW model run channels_last inside). That copy is made here once and kept until
    the weight's data or version changes; the parameter itself keeps its format. Other inputs and
    weights, and inference tensors (no version counter), are returned as they are."""
    if weight.dim() != 4 or not is_channels_last(x) or weight.is_contiguous(memory_format=torch.channels_last):
        return weight
    if weight.is_inference():
        return weight
    entry = _CHANNELS_LAST.get(weight)
    if entry is not None and entry[0] == weight.data_ptr() and entry[1] == weight._version:
        return entry[2]
    copied = weight.detach().contiguous(memory_format=torch.channels_last)
    _CHANNELS_LAST.put(weight, (weight.data_ptr(), weight._version, copied))
    return copied


def cached_channels_last(weight: torch.Tensor) -> torch.Tensor | None:
    """The channels_last copy cached for ``weight``, if a call made one."""
    entry = _CHANNELS_LAST.get(weight)
    return None if entry is None else entry[2]


def drop(weight: torch.Tensor) -> None:
    _PACKED.drop(weight)
    _CHANNELS_LAST.drop(weight)


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
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    groups: int,
    activation: str,
) -> torch.Tensor:
    """``activation(conv2d(x, weight, bias) [+ residual])`` on oneDNN, in F.conv2d's memory format."""
    packed = packed_weight(weight, x, stride, padding, dilation, groups)
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
def _(x, weight, bias, residual, stride, padding, dilation, groups, activation):
    return _empty(x, *output_layout(x, weight, stride, padding, dilation))
