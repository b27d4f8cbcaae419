"""``conv2d_3x3`` and ``conv2d_1x1``: convolutions with the bias and activation fused, forward and backward.

``conv2d_3x3(x, weight, bias, stride, padding, groups, activation)`` equals
``F.conv2d(x, weight, bias, stride, padding, groups=groups)`` followed by the
activation: None, ``"relu"``, ``"relu6"``, ``"hardswish"`` or ``"silu"``
(``F.relu``, ``F.relu6``, ``F.hardswish``, ``F.silu``), computed in one
kernel per output element (the bias and the activation are applied before
the single store). On CUDA a dense convolution with an activation other than
ReLU is cuDNN's convolution followed by one in-place activation pass (cuDNN
fuses only ReLU).

- ``x``: ``(N, C, H, W)`` or unbatched ``(C, H, W)`` (the output is then
  ``(K, Ho, Wo)``), contiguous or channels_last (anything else takes one
  ``.contiguous()`` in its suggested memory format); the output has x's
  memory format.
- ``weight``: ``(K, C / groups, 3, 3)``; ``groups`` is 1 (dense) or ``C``
  (depthwise, ``K`` a multiple of ``C``: channel multiplier ``K / C``).
- ``stride`` 1 or 2, ``padding`` 0 or 1 (zeros), each an int or an equal
  pair; ``padding`` may also be ``"same"`` (1, stride 1 only, as in
  ``F.conv2d``) or ``"valid"`` (0). Dilation 1.
- float32 / float64 / float16 / bfloat16; half types accumulate in float32.
  On CUDA the dense float32 path follows ``torch.backends.cudnn.allow_tf32``
  exactly as ``F.conv2d`` does; the depthwise path always computes in float32.

Checks, shape functions and autograd are C++ (csrc/conv.h, conv.cpp,
conv_autograd.cpp); the wrapper only names the arguments. Backward is the
op ``_conv2d_3x3_backward`` (grad x, grad weight, grad bias; a ReLU's mask
``result > 0`` is applied as grad_out is read, any other activation's
derivative by torch's own backward function first). When a graph is recorded,
hardswish and silu run as the convolution and then torch's activation, so
that the pre-activation their derivative needs is kept; without a graph
(inference) they are fused. Double backward raises NotImplementedError.

``conv2d_1x1(x, weight, bias, stride, activation)`` equals ``F.conv2d(x,
weight, bias, stride)`` with a ``(K, C, 1, 1)`` weight (groups 1, no padding,
any stride) followed by the activation. On CUDA a channels_last input runs
opforge's tensor-core GEMM with the bias and activation in its epilogue
(bfloat16, float16; float32 as TF32 where ``torch.backends.cudnn.allow_tf32``
allows it, as ``F.conv2d`` does, and C <= 512; C a multiple of 8, or of 4 for
float32); NCHW inputs, float64 and the rest run cuDNN's convolution, then the
bias and activation as one pass. On the CPU it is oneDNN's convolution and
one pass.
Its backward is ATen's (the activation's derivative, then
``convolution_backward``), so it is itself differentiable.

On CUDA an NCHW input without an activation is ``F.conv2d``'s own call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Each activation name's torch function: what the fused kernels apply after the conv.
TORCH_ACTIVATIONS = {None: None, "relu": F.relu, "relu6": F.relu6, "hardswish": F.hardswish, "silu": F.silu}

# The overload packet: a str padding ("same" / "valid") picks conv2d_3x3.padding.
_conv2d_3x3 = torch.ops.opforge.conv2d_3x3
_conv2d_1x1 = torch.ops.opforge.conv2d_1x1.default


def conv2d_3x3(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: int | tuple[int, int] = 1,
    padding: int | tuple[int, int] | str = 0,
    groups: int = 1,
    activation: str | None = None,
) -> torch.Tensor:
    """``F.conv2d(x, weight, bias, stride, padding, groups=groups)`` (+ the activation), fused.

    >>> import torch, opforge
    >>> x = torch.ones(1, 1, 4, 4)
    >>> opforge.conv2d_3x3(x, torch.ones(1, 1, 3, 3), torch.tensor([-10.0]), activation="relu")
    tensor([[[[0., 0.],
              [0., 0.]]]])
    """
    return _conv2d_3x3(x, weight, bias, stride, padding, groups, activation)


def conv2d_1x1(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: int | tuple[int, int] = 1,
    activation: str | None = None,
) -> torch.Tensor:
    """``F.conv2d(x, weight, bias, stride)`` for a 1x1 ``weight`` (+ the activation), fused.

    >>> import torch, opforge
    >>> x = torch.ones(1, 2, 2, 2)
    >>> opforge.conv2d_1x1(x, torch.ones(1, 2, 1, 1), torch.tensor([-3.0]), activation="relu6")
    tensor([[[[0., 0.],
              [0., 0.]]]])
    """
    return _conv2d_1x1(x, weight, bias, stride, activation)
