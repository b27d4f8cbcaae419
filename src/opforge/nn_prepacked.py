"""``PrepackedConv2d``: an inference conv with its activation fused by the vendor library.

On the CPU oneDNN runs it with the weight reordered once; on CUDA a ReLU
layer runs as cuDNN's fused convolution + bias + ReLU.

ATen's CPU convolution hands oneDNN a plain (K, C/groups, kh, kw) weight, and
oneDNN reorders it into its blocked layout on every call; for a layer with
a small output that reorder is a large part of the call. This module keeps
the reordered weight (rebuilt when the weight changes) and runs oneDNN's
convolution with the activation as its post-op, one call and one write of
the output, which is what ``torch.compile`` with freezing does for CPU
convolutions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import nn_prepacked_ops
from .nn_prepacked_ops import POST_OPS, is_channels_last
from .ops.conv import TORCH_ACTIVATIONS

# The dtypes cuDNN's fused convolution + bias + ReLU (and + add + ReLU) takes.
CUDNN_FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _pair(v, name: str) -> tuple[int, int]:
    pair = tuple(v) if isinstance(v, (tuple, list)) else (v, v)
    if len(pair) != 2 or not all(isinstance(p, int) and p >= 0 for p in pair):
        raise ValueError(f"PrepackedConv2d: {name} must be an int or a pair of non-negative ints, got {v!r}")
    return pair


def _onednn_dtypes() -> frozenset:
    if not torch.backends.mkldnn.is_available():
        return frozenset()
    dtypes = {torch.float32}
    dtypes |= {torch.bfloat16} if torch.ops.mkldnn._is_mkldnn_bf16_supported() else set()
    return frozenset(dtypes | ({torch.float16} if torch.ops.mkldnn._is_mkldnn_fp16_supported() else set()))


# Asked once, at import: torch.compile then reads a constant where it traces a layer.
_ONEDNN_DTYPES = _onednn_dtypes()


def onednn_runs(dtype: torch.dtype) -> bool:
    """Whether this build and CPU run oneDNN's convolution for ``dtype`` (the fast path)."""
    return dtype in _ONEDNN_DTYPES


class PrepackedConv2d(torch.nn.Module):
    """``activation(conv2d(x, weight, bias, stride, padding, dilation, groups))``, for CPU inference.

    On a 4-d CPU input of a dtype oneDNN runs here (float32; bfloat16 and
    float16 where the CPU has them), with no gradient being recorded, it is
    one oneDNN convolution with the weight reordered once into oneDNN's
    layout and the activation (None, ``"relu"``, ``"relu6"``, ``"hardswish"``,
    ``"silu"``) as its post-op. On CUDA with ``"relu"`` (float32, float16,
    bfloat16, no gradient recorded) it is cuDNN's fused convolution + bias +
    ReLU, one call. Everywhere else (training, other activations on CUDA,
    other dtypes, autocast, CUDA while ``torch.compile`` traces it, where
    inductor fuses the activation itself, and ``torch.export``) it is
    ``F.conv2d`` and the activation. A CUDA inference call on a
    channels_last input with an NCHW weight hands cuDNN a channels_last copy
    of the weight made once (ATen would copy it on every call), kept until
    the weight changes. Under ``torch.compile`` the CPU path
    stays one opaque op, ``opforge::onednn_conv`` (``opforge.nn_prepacked_ops``).
    The parameters are ``weight`` and ``bias``, as in ``nn.Conv2d``; the
    reordered copy is a cache, rebuilt when the weight is changed or moved (a
    change through ``.data`` needs ``invalidate()``), and never saved. The output has ``F.conv2d``'s memory format::

        conv = torch.nn.Conv2d(32, 64, 3, padding=1).eval()
        fast = opforge.nn.PrepackedConv2d.from_conv(conv, activation="relu")
        with torch.no_grad():
            y = fast(torch.randn(1, 32, 56, 56))   # == F.relu(conv(x))
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int],
        stride: int | tuple[int, int] = 1,
        padding: int | tuple[int, int] = 0,
        dilation: int | tuple[int, int] = 1,
        groups: int = 1,
        bias: bool = True,
        activation: str | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        if not (activation is None or (activation in POST_OPS and activation != "none")):
            raise ValueError(
                f"PrepackedConv2d: activation must be None, 'relu', 'relu6', 'hardswish' or 'silu', got {activation!r}"
            )
        self.stride, self.padding = _pair(stride, "stride"), _pair(padding, "padding")
        self.dilation = _pair(dilation, "dilation")
        # nn.Conv2d checks the channels and groups, and initialises the parameters as it does.
        ref = torch.nn.Conv2d(
            in_channels, out_channels, kernel_size, self.stride, self.padding, self.dilation, groups, bias,
            device=device, dtype=dtype,
        )  # fmt: skip
        self.in_channels, self.out_channels, self.kernel_size = in_channels, out_channels, ref.kernel_size
        self.groups, self.activation = groups, activation
        self.weight, self.bias = ref.weight, ref.bias

    @classmethod
    def from_conv(cls, conv: torch.nn.Conv2d, activation: str | None = None) -> PrepackedConv2d:
        """``conv`` followed by ``activation``, with copies of its parameters (same dtype, device,
        memory format and requires_grad) and in its mode."""
        if not isinstance(conv, torch.nn.Conv2d):
            raise TypeError(f"PrepackedConv2d.from_conv: conv must be a torch.nn.Conv2d, got {type(conv).__name__}")
        padding = explicit_padding(conv)
        if padding is None or conv.padding_mode != "zeros":
            raise ValueError(
                "PrepackedConv2d.from_conv: conv needs zero padding of a size both sides share, got padding "
                f"{conv.padding!r} and padding_mode {conv.padding_mode!r}"
            )
        layer = cls(
            conv.in_channels, conv.out_channels, tuple(conv.kernel_size), tuple(conv.stride), padding,
            tuple(conv.dilation), conv.groups, conv.bias is not None, activation,
            device="meta", dtype=conv.weight.dtype,
        )  # fmt: skip
        return with_params_of(layer, conv)

    def _weight_bias(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``weight`` and ``bias``, read once per call (see ``registered``)."""
        return registered(self, "_parameters", "weight"), registered(self, "_parameters", "bias")

    def _fast_path(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        # Run on every call: the cheapest tests first.
        if not x.is_cpu or x.dim() != 4 or x.dtype != weight.dtype or x.dtype not in _ONEDNN_DTYPES:
            return False
        if x.shape[1] != self.in_channels or records_grad(weight, bias, x):
            return False
        if torch.compiler.is_exporting() or torch.is_autocast_enabled("cpu"):
            return False  # export keeps torch's ops; autocast picks the conv's dtype: torch's ops do that
        # An inference weight has no version counter, so in-place changes to it could not be seen:
        # eager calls leave it to torch, the compiled op reorders it on each call.
        return torch.compiler.is_compiling() or not weight.is_inference()

    def _in_conv_format(self, y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """A oneDNN output in F.conv2d's memory format: channels_last when the input or the weight is."""
        cl = is_channels_last(x) or is_channels_last(weight)
        return y.contiguous(memory_format=torch.channels_last if cl else torch.contiguous_format)

    def packed_weight(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """The weight reordered for inputs shaped like ``x`` (cached, see ``opforge.nn_prepacked_ops``)."""
        weight = self._weight_bias()[0] if weight is None else weight
        return nn_prepacked_ops.packed_weight(weight, x, self.stride, self.padding, self.dilation, self.groups)

    @property
    def _packed(self) -> torch.Tensor | None:
        """The reordered weight cached for this layer's weight, if a oneDNN call made one."""
        return nn_prepacked_ops.cached(self.weight)

    def _compiled_call(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The oneDNN call as torch.compile traces it: one opaque op, which finds the weight's cache."""
        return torch.ops.opforge.onednn_conv(
            x, self.weight, self.bias, residual, list(self.stride), list(self.padding), list(self.dilation),
            self.groups, self.activation or "none",
        )  # fmt: skip

    def invalidate(self) -> None:
        """Drop the reordered weight. Needed only after changing the weight through ``.data``,
        which bypasses the version counter; every other change is seen."""
        nn_prepacked_ops.drop(self.weight)

    def _cudnn_path(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """cuDNN's fused convolution + bias + ReLU applies: CUDA, ReLU, a dtype cuDNN fuses, no graph."""
        if self.activation != "relu" or not x.is_cuda or x.dim() != 4 or torch.compiler.is_compiling():
            return False
        if torch.is_autocast_enabled("cuda"):
            return False
        if x.dtype != weight.dtype or x.dtype not in CUDNN_FUSED_DTYPES or not torch.backends.cudnn.enabled:
            return False
        return not records_grad(weight, bias, x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self._weight_bias()
        if self._cudnn_path(x, weight, bias):
            weight = nn_prepacked_ops.channels_last_weight(x, weight)
            return torch.cudnn_convolution_relu(x, weight, bias, self.stride, self.padding, self.dilation, self.groups)
        if self._fast_path(x, weight, bias):
            if torch.compiler.is_compiling():
                return self._compiled_call(x)
            attr, scalars = POST_OPS[self.activation or "none"]
            y = torch.ops.mkldnn._convolution_pointwise(
                x, self.packed_weight(x, weight), bias, self.padding, self.stride, self.dilation,
                self.groups, attr, scalars, "",
            )  # fmt: skip
            return self._in_conv_format(y, x, weight)
        y = F.conv2d(
            x, cuda_inference_weight(x, weight, bias), bias, self.stride, self.padding, self.dilation, self.groups
        )
        act = TORCH_ACTIVATIONS[self.activation]
        return act(y) if act is not None else y

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
            f"padding={self.padding}, dilation={self.dilation}, groups={self.groups}, "
            f"bias={self.bias is not None}, activation={self.activation!r}"
        )


def registered(module: torch.nn.Module, store: str, name: str):
    """``module.<name>`` read from its registry ``store`` (``"_parameters"``, ``"_buffers"``) where it
    is there, else as an attribute (a tensor a parametrization computes). For the per-call paths of
    opforge.nn's layers: Module.__getattr__ costs several times a dict lookup."""
    registry = getattr(module, store)  # an instance attribute: no Module.__getattr__
    return registry[name] if name in registry else getattr(module, name)


def cuda_inference_weight(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The weight a CUDA inference conv of ``x`` should be handed: its cached channels_last copy
    where ATen would copy it on every call (``nn_prepacked_ops.channels_last_weight``). Training
    (autograd records the call), traced calls and other devices take the weight as it is."""
    if not x.is_cuda or torch.compiler.is_compiling() or records_grad(weight, bias, x):
        return weight
    return nn_prepacked_ops.channels_last_weight(x, weight)


def records_grad(weight: torch.Tensor, bias: torch.Tensor | None, *inputs: torch.Tensor) -> bool:
    """Autograd records a call on these tensors: the fused engines have no backward, torch's ops do."""
    if not torch.is_grad_enabled():
        return False
    if weight.requires_grad or (bias is not None and bias.requires_grad):
        return True
    return any(t.requires_grad for t in inputs)


def with_params_of(layer: torch.nn.Module, conv: torch.nn.Conv2d) -> torch.nn.Module:
    """``layer`` holding copies of ``conv``'s weight and bias (same values, dtype, device,
    memory format and requires_grad; clone() keeps the strides) and in its mode. Shared by
    every ``from_conv`` of opforge.nn."""
    layer.weight = torch.nn.Parameter(conv.weight.detach().clone(), conv.weight.requires_grad)
    if conv.bias is not None:
        layer.bias = torch.nn.Parameter(conv.bias.detach().clone(), conv.bias.requires_grad)
    return layer.train(conv.training)


def explicit_padding(conv: torch.nn.Conv2d) -> tuple[int, int] | None:
    """The conv's padding as (ph, pw), or None where it pads the two sides differently."""
    if conv.padding == "valid":
        return (0, 0)
    if conv.padding == "same":
        total = [d * (k - 1) for d, k in zip(conv.dilation, conv.kernel_size)]
        return None if any(t % 2 for t in total) else (total[0] // 2, total[1] // 2)
    return tuple(conv.padding)
