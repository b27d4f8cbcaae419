"""nn.Module wrappers of opforge ops, for use inside models."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .nn_conv_batch_norm import BatchNormAct2d as BatchNormAct2d
from .nn_conv_batch_norm import BatchNormInConv as BatchNormInConv
from .nn_conv_batch_norm import ConvBatchNorm2d as ConvBatchNorm2d
from .nn_prepacked import PrepackedConv2d as PrepackedConv2d
from .nn_prepacked import with_params_of as _with_params_of
from .nn_residual import ConvResidual as ConvResidual
from .nn_squeeze_excitation import SqueezeExcitation as SqueezeExcitation
from .ops.add import add, add_relu
from .ops.conv import TORCH_ACTIVATIONS, conv2d_1x1, conv2d_3x3
from .ops.softmax import log_softmax, scaled_masked_softmax, softmax


class Add(torch.nn.Module):
    """``forward(a, b) = a + b`` (opforge.add)."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return add(a, b)


class AddReLU(torch.nn.Module):
    """``forward(a, b) = relu(a + b)`` in one kernel (opforge.add_relu).

    A residual block's ``relu(x + shortcut)`` or a bias-then-ReLU is a
    drop-in use::

        class Block(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = torch.nn.Linear(64, 64)
                self.act = opforge.nn.AddReLU()
            def forward(self, x):
                return self.act(self.fc(x), x)
    """

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return add_relu(a, b)


class Softmax(torch.nn.Module):
    """``forward(x) = softmax(x, dim)`` (opforge.softmax); a drop-in for ``torch.nn.Softmax``."""

    def __init__(self, dim: int = -1):
        super().__init__()
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return softmax(x, self.dim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


class LogSoftmax(torch.nn.Module):
    """``forward(x) = log_softmax(x, dim)`` (opforge.log_softmax); a drop-in for ``torch.nn.LogSoftmax``."""

    def __init__(self, dim: int = -1):
        super().__init__()
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return log_softmax(x, self.dim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


class ScaledMaskedSoftmax(torch.nn.Module):
    """``forward(scores, mask=None) = softmax(scores * scale + mask, -1)`` in one pass
    (opforge.scaled_masked_softmax), with an optional causal mask.

    In an attention block::

        attn = opforge.nn.ScaledMaskedSoftmax(scale=head_dim ** -0.5, causal=True)
        p = attn(q @ k.transpose(-2, -1))          # (..., Lq, Lk)
        out = p @ v
    """

    def __init__(self, scale: float = 1.0, causal: bool = False):
        super().__init__()
        self.scale = float(scale)
        self.causal = bool(causal)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return scaled_masked_softmax(x, mask, self.scale, self.causal)

    def extra_repr(self) -> str:
        return f"scale={self.scale}, causal={self.causal}"


class Conv2d3x3(torch.nn.Module):
    """A 3x3 ``nn.Conv2d`` (optionally followed by an activation) as one fused op (opforge.conv2d_3x3).

    Same parameters and initialisation as ``torch.nn.Conv2d(in_channels,
    out_channels, 3, stride, padding, groups=groups, bias=bias)``; ``stride``
    and ``padding`` as ``conv2d_3x3`` takes them (an int or an equal pair,
    padding also ``"same"`` / ``"valid"``), ``groups`` 1 or ``in_channels``
    (depthwise, ``out_channels`` a multiple of it); ``activation`` is None,
    ``"relu"``, ``"relu6"``, ``"hardswish"`` or ``"silu"``. The arguments are
    checked once, here, by the op's own contract.
    ``Conv2d3x3.from_conv(conv, activation="relu6")`` converts a trained layer
    (and the activation after it), keeping its parameters' memory format::

        block = torch.nn.Sequential(conv, torch.nn.ReLU6())
        fused = opforge.nn.Conv2d3x3.from_conv(block[0], activation="relu6")

    ``torch_when_compiled = True`` makes the layer trace as torch's conv and
    activation under ``torch.compile`` and ``torch.export`` (eager calls
    still run opforge's op), for layers where inductor's own fusion of the
    two is the faster one; ``opforge.optimize`` sets it from a timing.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        stride: int | tuple[int, int] = 1,
        padding: int | tuple[int, int] | str = 0,
        groups: int = 1,
        bias: bool = True,
        activation: str | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        # Initialised exactly as nn.Conv2d (kaiming_uniform(a=sqrt(5)), bias U(-1/sqrt(fan_in), +)).
        ref = torch.nn.Conv2d(
            in_channels, out_channels, 3, stride, padding, groups=groups, bias=bias, device=device, dtype=dtype
        )
        # The op's checks on a meta input (nothing is computed): an argument it
        # refuses is refused now, with its message, rather than at the first call.
        meta = torch.empty((in_channels, 3, 3), device="meta", dtype=ref.weight.dtype)
        conv2d_3x3(meta, ref.weight.detach().to("meta"), None, stride, padding, groups, activation)
        self.in_channels, self.out_channels = in_channels, out_channels
        self.stride, self.padding, self.groups, self.activation = stride, padding, groups, activation
        self.weight = ref.weight
        self.bias = ref.bias
        self.torch_when_compiled = False

    @classmethod
    def from_conv(cls, conv: torch.nn.Conv2d, relu: bool = False, activation: str | None = None) -> Conv2d3x3:
        """The fused equivalent of ``conv`` followed by ``activation`` (``relu=True``: ``"relu"``).

        The values are copied into parameters of the same dtype, device and
        memory format as ``conv``'s."""
        if relu and activation not in (None, "relu"):
            raise ValueError(f"Conv2d3x3.from_conv: relu=True contradicts activation={activation!r}")
        if not isinstance(conv, torch.nn.Conv2d):
            raise TypeError(f"Conv2d3x3.from_conv: conv must be a torch.nn.Conv2d, got {type(conv).__name__}")
        if tuple(conv.kernel_size) != (3, 3):
            raise ValueError(f"Conv2d3x3.from_conv: conv must have a 3x3 kernel, got {tuple(conv.kernel_size)}")
        if tuple(conv.dilation) != (1, 1) or conv.padding_mode != "zeros":
            raise ValueError(
                f"Conv2d3x3.from_conv: conv needs dilation 1 and zero padding, got dilation "
                f"{conv.dilation} and padding_mode {conv.padding_mode!r}"
            )
        layer = cls(
            conv.in_channels,
            conv.out_channels,
            tuple(conv.stride),
            conv.padding if isinstance(conv.padding, str) else tuple(conv.padding),
            conv.groups,
            conv.bias is not None,
            "relu" if relu else activation,
            device="meta",
            dtype=conv.weight.dtype,
        )
        return _with_params_of(layer, conv)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.torch_when_compiled and torch.compiler.is_compiling():
            return _torch_conv(self, x, self.padding, self.groups)
        return conv2d_3x3(x, self.weight, self.bias, self.stride, self.padding, self.groups, self.activation)

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, stride={self.stride}, padding={self.padding}, "
            f"groups={self.groups}, bias={self.bias is not None}, activation={self.activation!r}"
            + (", torch_when_compiled=True" if self.torch_when_compiled else "")
        )


def _torch_conv(layer: torch.nn.Module, x: torch.Tensor, padding, groups: int) -> torch.Tensor:
    """The layer as torch's own conv and activation (what it computes, in torch's ops)."""
    y = F.conv2d(x, layer.weight, layer.bias, layer.stride, padding, 1, groups)
    act = TORCH_ACTIVATIONS[layer.activation]
    return act(y) if act is not None else y


class Conv2d1x1(torch.nn.Module):
    """A 1x1 ``nn.Conv2d`` (optionally followed by an activation) as one fused op (opforge.conv2d_1x1).

    Same parameters and initialisation as ``torch.nn.Conv2d(in_channels,
    out_channels, 1, stride, bias=bias)`` (groups 1, no padding);
    ``activation`` is None, ``"relu"``, ``"relu6"``, ``"hardswish"`` or
    ``"silu"``. ``Conv2d1x1.from_conv(conv, activation="relu6")`` converts a
    trained layer (and the activation after it), keeping its parameters'
    memory format::

        block = torch.nn.Sequential(torch.nn.Conv2d(32, 192, 1), torch.nn.ReLU6())
        fused = opforge.nn.Conv2d1x1.from_conv(block[0], activation="relu6")

    ``torch_when_compiled`` is as for :class:`Conv2d3x3`.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        stride: int | tuple[int, int] = 1,
        bias: bool = True,
        activation: str | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        ref = torch.nn.Conv2d(in_channels, out_channels, 1, stride, bias=bias, device=device, dtype=dtype)
        # The op's checks on a meta input: a refused argument is refused now, with its message.
        meta = torch.empty((in_channels, 1, 1), device="meta", dtype=ref.weight.dtype)
        conv2d_1x1(meta, ref.weight.detach().to("meta"), None, stride, activation)
        self.in_channels, self.out_channels = in_channels, out_channels
        self.stride, self.activation = stride, activation
        self.weight = ref.weight
        self.bias = ref.bias
        self.torch_when_compiled = False

    @classmethod
    def from_conv(cls, conv: torch.nn.Conv2d, activation: str | None = None) -> Conv2d1x1:
        """The fused equivalent of ``conv`` followed by ``activation``, with copies of its parameters."""
        if not isinstance(conv, torch.nn.Conv2d):
            raise TypeError(f"Conv2d1x1.from_conv: conv must be a torch.nn.Conv2d, got {type(conv).__name__}")
        # "same" and "valid" both mean no padding for a 1x1 kernel; dilation does not apply to it.
        padding = (0, 0) if isinstance(conv.padding, str) else tuple(conv.padding)
        if tuple(conv.kernel_size) != (1, 1) or conv.groups != 1 or padding != (0, 0):
            raise ValueError(
                "Conv2d1x1.from_conv: conv must have a 1x1 kernel, groups 1 and no padding, got kernel "
                f"{tuple(conv.kernel_size)}, groups {conv.groups}, padding {conv.padding}"
            )
        layer = cls(
            conv.in_channels,
            conv.out_channels,
            tuple(conv.stride),
            conv.bias is not None,
            activation,
            device="meta",
            dtype=conv.weight.dtype,
        )
        return _with_params_of(layer, conv)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.torch_when_compiled and torch.compiler.is_compiling():
            return _torch_conv(self, x, 0, 1)
        return conv2d_1x1(x, self.weight, self.bias, self.stride, self.activation)

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, stride={self.stride}, "
            f"bias={self.bias is not None}, activation={self.activation!r}"
            + (", torch_when_compiled=True" if self.torch_when_compiled else "")
        )
