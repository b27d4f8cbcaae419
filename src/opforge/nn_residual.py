"""``ConvResidual``: a residual block's tail, ``activation(conv2d(x) + residual)``, as one layer.

A ResNet block ends with ``relu(bn(conv(x)) + shortcut)``: in eager PyTorch
three or four passes over the block's output. With the BatchNorm folded into
the conv, this layer runs the rest on one of four engines, picked by
``opforge.optimize`` from timings on the layer's own input:

- ``"torch"``: ``F.conv2d``, then the add and the activation (two passes);
- ``"add_relu"``: ``F.conv2d``, then ``opforge.add_relu`` (one pass; ReLU only);
- ``"cudnn"``: cuDNN's fused convolution + add + ReLU, one call (CUDA, ReLU only);
- ``"onednn"``: oneDNN's convolution with the add and the ReLU (if any) as
  its post-ops and the weight reordered once (CPU inference).

Where an engine cannot run the call (training, another device or dtype, a
residual of another shape, ``torch.export``, or while ``torch.compile``
traces the layer, where inductor fuses the add and activation itself) the
layer computes the same thing with torch's ops; under ``torch.compile`` the
``"onednn"`` engine stays one opaque op (``opforge.nn_prepacked_ops``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import nn_prepacked_ops
from .nn_prepacked import CUDNN_FUSED_DTYPES, PrepackedConv2d, cuda_inference_weight, records_grad
from .nn_prepacked_ops import output_layout
from .ops.add import add_relu
from .ops.conv import TORCH_ACTIVATIONS

ENGINES = ("torch", "add_relu", "cudnn", "onednn")
# oneDNN applies no other activation after an add post-op.
ONEDNN_ACTIVATIONS = ("relu", None)


class ConvResidual(PrepackedConv2d):
    """``forward(x, residual) = activation(conv2d(x, weight, bias, ...) + residual)``.

    The parameters are ``weight`` and ``bias``, as in ``nn.Conv2d``;
    ``activation`` is None, ``"relu"``, ``"relu6"``, ``"hardswish"`` or
    ``"silu"``; ``engine`` is one of ``ENGINES`` (see the module's docs).
    ``opforge.optimize`` builds it from a ``Conv2d -> BatchNorm2d -> add ->
    activation`` tail with the BatchNorm folded::

        conv = torch.nn.Conv2d(64, 64, 3, padding=1).eval()
        tail = opforge.nn.ConvResidual.from_conv(conv, activation="relu", engine="add_relu")
        y = tail(x, shortcut)   # == F.relu(conv(x) + shortcut)
    """

    def __init__(self, *args, engine: str = "torch", **kwargs):
        super().__init__(*args, **kwargs)
        self.engine = engine

    @property
    def engine(self) -> str:
        return self._engine

    @engine.setter
    def engine(self, engine: str) -> None:
        if engine not in ENGINES:
            raise ValueError(f"ConvResidual: engine must be one of {ENGINES}, got {engine!r}")
        if engine in ("add_relu", "cudnn") and self.activation != "relu":
            raise ValueError(f"ConvResidual: engine {engine!r} fuses ReLU only, got activation {self.activation!r}")
        if engine == "onednn" and self.activation not in ONEDNN_ACTIVATIONS:
            raise ValueError(f"ConvResidual: engine 'onednn' fuses ReLU or none, got activation {self.activation!r}")
        self._engine = engine

    @classmethod
    def from_conv(cls, conv: torch.nn.Conv2d, activation: str | None = None, engine: str = "torch") -> ConvResidual:
        """``activation(conv(x) + residual)``, with copies of ``conv``'s parameters, in its mode."""
        layer = super().from_conv(conv, activation)
        layer.engine = engine
        return layer

    def _torch(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        weight = cuda_inference_weight(x, weight, bias)
        y = F.conv2d(x, weight, bias, self.stride, self.padding, self.dilation, self.groups) + residual
        act = TORCH_ACTIVATIONS[self.activation]
        return act(y) if act is not None else y

    def _output_sizes(self, x: torch.Tensor, weight: torch.Tensor) -> tuple[int, ...]:
        """The conv output's shape for ``x``, kept for the last input and weight shapes (asked per call)."""
        if torch.compiler.is_compiling():  # a trace keeps no state on the module
            return tuple(output_layout(x, weight, self.stride, self.padding, self.dilation)[0])
        cached = self.__dict__.get("_sizes_for")
        if cached is not None and cached[0] == x.shape and cached[1] == weight.shape:
            return cached[2]
        sizes = tuple(output_layout(x, weight, self.stride, self.padding, self.dilation)[0])
        self.__dict__["_sizes_for"] = (x.shape, weight.shape, sizes)
        return sizes

    def _fused_call_fits(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> bool:
        """The fused engines take a residual of the conv output's shape, dtype and device, no graph."""
        if x.dim() != 4 or residual.dim() != 4 or residual.dtype != x.dtype:
            return False
        if x.dtype != weight.dtype or residual.get_device() != x.get_device():
            return False
        if torch.compiler.is_exporting() or torch.is_autocast_enabled(x.device.type):
            return False  # autocast picks the conv's dtype: torch's ops do that
        return not records_grad(weight, bias, x, residual) and residual.shape == self._output_sizes(x, weight)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        engine = self._engine
        weight, bias = self._weight_bias()
        onednn = engine == "onednn" and self._fast_path(x, weight, bias)
        if onednn and self._fused_call_fits(x, residual, weight, bias):
            if torch.compiler.is_compiling():
                return self._compiled_call(x, residual)
            y = torch.ops.mkldnn._convolution_pointwise.binary(
                x, residual, self.packed_weight(x, weight), bias, self.padding, self.stride,
                self.dilation, self.groups, "add", None, self.activation, [], "",
            )  # fmt: skip
            return self._in_conv_format(y, x, weight)
        cudnn = engine == "cudnn" and x.is_cuda and x.dtype in CUDNN_FUSED_DTYPES and not torch.compiler.is_compiling()
        if cudnn and self._fused_call_fits(x, residual, weight, bias):  # CUDA, nothing recorded or traced
            weight = nn_prepacked_ops.channels_last_weight(x, weight)
            return torch.cudnn_convolution_add_relu(
                x, weight, residual, 1.0, bias, self.stride, self.padding, self.dilation, self.groups
            )
        if engine == "add_relu" and not torch.compiler.is_compiling():
            conv_weight = cuda_inference_weight(x, weight, bias)
            y = F.conv2d(x, conv_weight, bias, self.stride, self.padding, self.dilation, self.groups)
            if y.shape == residual.shape and y.dtype == residual.dtype:
                return add_relu(y, residual)
            return F.relu(y + residual)
        return self._torch(x, residual, weight, bias)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", engine={self._engine!r}"
