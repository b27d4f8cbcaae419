"""BatchNorm folding: ``bn(conv(x)) == conv'(x)`` for a conv whose only reader is the BatchNorm.

In eval mode BatchNorm is an affine map per channel, ``y = (z - mean) *
gamma / sqrt(var + eps) + beta``, so it folds into the conv before it:
``w' = w * s`` (per output channel), ``b' = (b - mean) * s + beta`` with
``s = gamma / sqrt(var + eps)``. The arithmetic runs in float64 and is
rounded once to the conv's dtype, so folding adds one rounding per weight.
"""

from __future__ import annotations

import torch

from .nn_prepacked import PrepackedConv2d, explicit_padding


def folded_weight_and_bias(
    weight: torch.Tensor, bias: torch.Tensor | None, bn: torch.nn.BatchNorm2d
) -> tuple[torch.Tensor, torch.Tensor]:
    """The conv's weight and bias with ``bn`` (eval mode) folded in, in the weight's dtype and memory format."""
    if bn.running_mean is None or bn.running_var is None:
        raise ValueError("optimize: a BatchNorm2d without running statistics cannot be folded")
    k = weight.shape[0]
    mean = bn.running_mean.detach().double()
    scale = torch.rsqrt(bn.running_var.detach().double() + bn.eps)
    if bn.weight is not None:
        scale = scale * bn.weight.detach().double()
    shift = bn.bias.detach().double() if bn.bias is not None else torch.zeros_like(mean)
    b = bias.detach().double() if bias is not None else torch.zeros(k, dtype=torch.float64, device=weight.device)
    # Elementwise ops keep the weight's strides: a channels_last weight stays so.
    w = (weight.detach().double() * scale.reshape(-1, *([1] * (weight.dim() - 1)))).to(weight.dtype)
    return w, ((b - mean) * scale + shift).to(weight.dtype)


def folded_conv(conv: torch.nn.Conv2d, bn: torch.nn.BatchNorm2d) -> torch.nn.Conv2d:
    """A new ``nn.Conv2d`` computing ``bn(conv(x))`` (both in eval mode), with a bias."""
    weight, bias = folded_weight_and_bias(conv.weight, conv.bias, bn)
    out = torch.nn.Conv2d(
        conv.in_channels,
        conv.out_channels,
        conv.kernel_size,
        conv.stride,
        conv.padding,
        conv.dilation,
        conv.groups,
        bias=True,
        padding_mode=conv.padding_mode,
        device=conv.weight.device,
        dtype=conv.weight.dtype,
    )
    out.weight = torch.nn.Parameter(weight, requires_grad=conv.weight.requires_grad)
    out.bias = torch.nn.Parameter(bias, requires_grad=conv.weight.requires_grad)
    return out.train(conv.training)


def copies_weight_once(conv: torch.nn.Conv2d) -> bool:
    """Folded, ``conv`` is installed as a layer that hands cuDNN a channels_last copy of its weight
    made once (``as_installed``): a CUDA conv with zero padding whose weight is not channels_last."""
    weight = conv.weight
    if not weight.is_cuda or weight.is_contiguous(memory_format=torch.channels_last):
        return False
    return conv.padding_mode == "zeros" and explicit_padding(conv) is not None


def as_installed(folded: torch.nn.Conv2d) -> torch.nn.Module:
    """The folded conv as optimize installs it where no fused kernel replaces it. On CUDA a conv
    whose weight is not channels_last becomes a ``PrepackedConv2d`` without an activation: the
    same cuDNN convolution, except that with channels_last inputs (an NCHW model run
    channels_last inside) the channels_last copy of the weight ATen makes per call is made once."""
    return PrepackedConv2d.from_conv(folded) if copies_weight_once(folded) else folded
