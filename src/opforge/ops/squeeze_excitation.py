"""``squeeze_excitation``: a squeeze-and-excitation block as one op call.

``squeeze_excitation(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias,
activation, scale_activation)`` is ``x * scale_activation(fc2(activation(
fc1(mean of x over H and W))))``, what torchvision's ``SqueezeExcitation``
computes (MobileNetV3, EfficientNet, RegNet). The schema, checks and kernel
are C++ (csrc/squeeze_excitation.cpp): one call runs the pooling, the two
matrix products and the scaling as ATen kernels, where the module makes six
or seven Python calls. It is a composite of ATen ops: autograd
differentiates them and ``torch.compile`` traces them as torch's;
``torch.export`` keeps the op as one node, which ``run_decompositions()``
turns into those ops.
"""

from __future__ import annotations

import torch

ACTIVATIONS = ("relu", "relu6", "silu", "hardswish")
SCALE_ACTIVATIONS = ("sigmoid", "hardsigmoid")

_op = torch.ops.opforge.squeeze_excitation


def squeeze_excitation(
    x: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc1_bias: torch.Tensor | None,
    fc2_weight: torch.Tensor,
    fc2_bias: torch.Tensor | None,
    activation: str = "relu",
    scale_activation: str = "sigmoid",
) -> torch.Tensor:
    """``x * scale_activation(fc2(activation(fc1(x.mean((-2, -1))))))``, broadcast over H and W.

    ``x`` is (N, C, H, W) or unbatched (C, H, W), any memory format (the
    output keeps it); ``fc1_weight`` is (S, C) or a 1x1 conv's (S, C, 1, 1),
    ``fc2_weight`` (C, S) or (C, S, 1, 1), the biases (S,) and (C,) or None.
    ``activation``: ``"relu"``, ``"relu6"``, ``"silu"``, ``"hardswish"``;
    ``scale_activation``: ``"sigmoid"``, ``"hardsigmoid"``. Every float dtype.

    >>> import torch, opforge
    >>> x = torch.randn(2, 16, 7, 7)
    >>> w1, b1, w2, b2 = torch.randn(4, 16), torch.randn(4), torch.randn(16, 4), torch.randn(16)
    >>> y = opforge.squeeze_excitation(x, w1, b1, w2, b2, "relu", "hardsigmoid")
    >>> gate = torch.nn.functional.hardsigmoid(torch.relu(x.mean((2, 3)) @ w1.T + b1) @ w2.T + b2)
    >>> torch.allclose(y, x * gate[:, :, None, None], atol=1e-6)
    True
    """
    return _op(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, activation, scale_activation)
