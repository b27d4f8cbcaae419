"""``conv2d_3x3``: 3x3 convolution with the bias and ReLU fused, forward and backward.

``conv2d_3x3(x, weight, bias, stride, padding, groups, activation)`` equals
``F.conv2d(x, weight, bias, stride, padding, groups=groups)`` followed by
``torch.relu`` when ``activation == "relu"``, computed in one kernel per
output element (the bias and the ReLU are applied before the single store).

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
op ``_conv2d_3x3_backward`` (grad x, grad weight, grad bias with the ReLU
mask ``result > 0`` fused in); double backward raises NotImplementedError.
"""

from __future__ import annotations

import torch

# The overload packet: a str padding ("same" / "valid") picks conv2d_3x3.padding.
_conv2d_3x3 = torch.ops.opforge.conv2d_3x3


def conv2d_3x3(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: int | tuple[int, int] = 1,
    padding: int | tuple[int, int] | str = 0,
    groups: int = 1,
    activation: str | None = None,
) -> torch.Tensor:
    """``F.conv2d(x, weight, bias, stride, padding, groups=groups)`` (+ ``relu``), fused.

    >>> import torch, opforge
    >>> x = torch.ones(1, 1, 4, 4)
    >>> opforge.conv2d_3x3(x, torch.ones(1, 1, 3, 3), torch.tensor([-10.0]), activation="relu")
    tensor([[[[0., 0.],
              [0., 0.]]]])
    """
    return _conv2d_3x3(x, weight, bias, stride, padding, groups, activation)
