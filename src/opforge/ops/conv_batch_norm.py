"""``conv2d_batch_norm``: ``Conv2d -> BatchNorm2d`` (training mode) ``-> activation`` in one call.

``conv2d_batch_norm(x, weight, bias, bn_weight, bn_bias, running_mean,
running_var, num_batches_tracked, stride, padding, dilation, groups,
momentum, eps, activation)`` equals::

    y = F.conv2d(x, weight, bias, stride, padding, dilation, groups)
    y = F.batch_norm(y, running_mean, running_var, bn_weight, bn_bias, training=True,
                     momentum=momentum, eps=eps)
    num_batches_tracked += 1      # when given, with running statistics
    activation(y)                 # None, "relu", "relu6", "hardswish", "silu"

with ATen's convolution. The batch norm and the activation run on ATen's
kernels (then the output, the gradients and the updated running statistics
are exactly those of ``nn.Conv2d``, ``nn.BatchNorm2d`` in training mode and
the activation module), except for a channels_last CUDA conv output, which
goes to opforge's own batch norm + activation engine: three launches each
way, the activation and its derivative inside the batch norm's passes,
values within a rounding of the modules'. What it saves is host time (one
op call and one autograd node instead of three modules, three calls and
three nodes) and, on the own engine, the activation's passes over memory.

- ``x`` (N, C, H, W), ``weight`` (K, C / groups, kH, kW), both of one dtype;
  ``bias``, ``bn_weight``, ``bn_bias``, ``running_mean``, ``running_var``
  (K,) or None; ``num_batches_tracked`` a one-element tensor or None.
- ``stride``, ``padding`` (zeros), ``dilation``: an int or a pair.
- Running statistics are updated in place (``momentum`` as in
  ``nn.BatchNorm2d``; a cumulative average, ``momentum=None``, is
  ``nn.BatchNorm2d``'s own job). Without them the batch's statistics alone
  normalize, as in ``nn.BatchNorm2d(track_running_stats=False)``.
- Every floating dtype the three modules take; CPU and CUDA.
- Gradients for x, weight, bias, bn_weight and bn_bias; the backward is
  ATen's (the activation's derivative, the batch norm's, the convolution's).

``opforge.nn.ConvBatchNorm2d`` is the module; ``opforge.optimize`` puts it
in training models.
"""

from __future__ import annotations

import torch

_conv2d_batch_norm = torch.ops.opforge.conv2d_batch_norm.default


def conv2d_batch_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    bn_weight: torch.Tensor | None,
    bn_bias: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    num_batches_tracked: torch.Tensor | None = None,
    stride: int | tuple[int, int] = 1,
    padding: int | tuple[int, int] = 0,
    dilation: int | tuple[int, int] = 1,
    groups: int = 1,
    momentum: float = 0.1,
    eps: float = 1e-5,
    activation: str | None = None,
) -> torch.Tensor:
    """``activation(F.batch_norm(F.conv2d(x, ...), training=True))`` in one call (see the module's docs).

    >>> import torch, opforge
    >>> x, w = torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3)
    >>> mean, var = torch.zeros(4), torch.ones(4)
    >>> y = opforge.conv2d_batch_norm(x, w, None, None, None, mean, var, padding=1, activation="relu")
    >>> ref = torch.relu(torch.nn.functional.batch_norm(torch.nn.functional.conv2d(x, w, padding=1), None, None,
    ...                                                 training=True))
    >>> torch.equal(y, ref), bool(mean.abs().sum() > 0)
    (True, True)
    """
    return _conv2d_batch_norm(
        x,
        weight,
        bias,
        bn_weight,
        bn_bias,
        running_mean,
        running_var,
        num_batches_tracked,
        stride,
        padding,
        dilation,
        groups,
        momentum,
        eps,
        activation,
    )
