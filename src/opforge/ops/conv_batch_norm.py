"""``conv2d_batch_norm``: ``Conv2d -> BatchNorm2d`` (training mode) ``-> activation`` in one call.

``conv2d_batch_norm(x, weight, bias, bn_weight, bn_bias, running_mean,
running_var, num_batches_tracked, stride, padding, dilation, groups,
momentum, eps, activation, residual)`` equals::

    y = F.conv2d(x, weight, bias, stride, padding, dilation, groups)
    y = F.batch_norm(y, running_mean, running_var, bn_weight, bn_bias, training=True,
                     momentum=momentum, eps=eps)
    num_batches_tracked += 1      # when given, with running statistics
    y = y + residual              # when given: a residual block's shortcut
    activation(y)                 # None, "relu", "relu6", "hardswish", "silu"

with ATen's convolution. The batch norm and the activation run on opforge's
own engine where it takes the conv output: on the CPU a float32, float16 or
bfloat16 output, NCHW or channels_last (csrc/cpu/batch_norm_act_cpu.cpp:
two passes for the statistics, one for the output, the activation inside;
parallel over channels or over blocks of rows); on CUDA a channels_last one
(csrc/cuda/batch_norm_act.cu: three launches each way). Its values are
within a rounding of the modules'. Elsewhere (float64, an NCHW CUDA output,
fake tensors) the op runs ATen's kernels, and the output, the gradients and
the updated running statistics are exactly those of ``nn.Conv2d``,
``nn.BatchNorm2d`` in training mode and the activation module. What it
saves is host time (one op call and one autograd node instead of three
modules, three calls and three nodes) and, on the own engine, the
activation's passes over memory.

- ``x`` (N, C, H, W), ``weight`` (K, C / groups, kH, kW), both of one dtype;
  ``bias``, ``bn_weight``, ``bn_bias``, ``running_mean``, ``running_var``
  (K,) or None; ``num_batches_tracked`` a one-element tensor or None.
- ``stride``, ``padding`` (zeros), ``dilation``: an int or a pair.
- Running statistics are updated in place (``momentum`` as in
  ``nn.BatchNorm2d``; a cumulative average, ``momentum=None``, is
  ``nn.BatchNorm2d``'s own job). Without them the batch's statistics alone
  normalize, as in ``nn.BatchNorm2d(track_running_stats=False)``.
- ``residual``: None, or a tensor of the conv output's shape and dtype (a
  ResNet block's tail, ``relu(bn(conv(x)) + shortcut)``). The CUDA engine
  adds it inside its output pass (it reads the residual where the output is
  written, and in the backward where the activation's derivative needs the
  pre-activation) when it is laid out as the conv output; elsewhere the add
  is ATen's, in place on the batch norm's output.
- Every floating dtype the three modules take; CPU and CUDA.
- Gradients for x, weight, bias, bn_weight, bn_bias and residual: the
  activation's derivative and the batch norm's on the engine the forward
  ran, then ATen's convolution backward.

``opforge.nn.ConvBatchNorm2d`` is the module; ``opforge.optimize`` puts it
in training models.
"""

from __future__ import annotations

import torch

_conv2d_batch_norm = torch.ops.opforge.conv2d_batch_norm.default
_batch_norm_act = torch.ops.opforge.batch_norm_act.default


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
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``activation(F.batch_norm(F.conv2d(x, ...), training=True) [+ residual])`` in one call (see the
    module's docs).

    >>> import torch, opforge
    >>> x, w = torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3)
    >>> mean, var = torch.zeros(4), torch.ones(4)
    >>> y = opforge.conv2d_batch_norm(x, w, None, None, None, mean, var, padding=1, activation="relu")
    >>> ref = torch.relu(torch.nn.functional.batch_norm(torch.nn.functional.conv2d(x, w, padding=1), None, None,
    ...                                                 training=True))
    >>> torch.allclose(y, ref, atol=1e-5), bool(mean.abs().sum() > 0)
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
        residual,
    )


def batch_norm_act(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    num_batches_tracked: torch.Tensor | None = None,
    momentum: float = 0.1,
    eps: float = 1e-5,
    activation: str | None = None,
) -> torch.Tensor:
    """``activation(F.batch_norm(x, training=True))`` in one call, one autograd node: the batch norm
    half of :func:`conv2d_batch_norm`, for a conv that is not ATen's (opforge's own), on the same
    engines. ``x`` (N, C, H, W); the rest as in ``conv2d_batch_norm``.

    >>> import torch, opforge
    >>> x, mean, var = torch.randn(2, 4, 8, 8), torch.zeros(4), torch.ones(4)
    >>> y = opforge.batch_norm_act(x, None, None, mean, var, activation="relu6")
    >>> ref = torch.nn.functional.relu6(torch.nn.functional.batch_norm(x, None, None, training=True))
    >>> torch.allclose(y, ref, atol=1e-5), bool(mean.abs().sum() > 0)
    (True, True)
    """
    return _batch_norm_act(x, weight, bias, running_mean, running_var, num_batches_tracked, momentum, eps, activation)


# The dtypes of a conv output that opforge's own batch norm engines (CPU and CUDA) take.
_OWN_ENGINE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def why_not_own_engine(conv_out: torch.Tensor, bn: torch.nn.BatchNorm2d) -> str:
    """Why ``conv2d_batch_norm`` would run ``bn`` on ``conv_out`` with ATen's kernels, in a few
    words; "" where it runs opforge's own engine.

    The rules of ``cpu_engine_takes`` (csrc/cpu/batch_norm_act_cpu.cpp) and
    ``cuda_engine_takes`` (csrc/cuda/batch_norm_act.cu): a 4-d tensor of
    float32, float16 or bfloat16 with more than one value per channel, NCHW
    or channels_last on the CPU, channels_last on CUDA (in a build with CUDA
    kernels), and BatchNorm tensors on its device, contiguous, all of one
    dtype (its own or float32)."""
    y = conv_out
    if y.device.type not in ("cpu", "cuda"):
        return f"on the {y.device.type.upper()}"
    if y.dtype not in _OWN_ENGINE_DTYPES:
        return str(y.dtype).removeprefix("torch.")
    if y.dim() != 4:
        return "not a 4-d conv output"
    channels_last = y.is_contiguous(memory_format=torch.channels_last)
    if y.is_cuda and not channels_last:
        return "an NCHW conv output"
    if not y.is_cuda and not (channels_last or y.is_contiguous()):
        return "a conv output neither NCHW nor channels_last"
    if y.numel() == 0 or y.numel() // y.size(1) < 2:
        return "one value per channel"
    params = [t for t in (bn.weight, bn.bias, bn.running_mean) if t is not None]
    if any(t.device != y.device or not t.is_contiguous() or t.dtype not in (y.dtype, torch.float32) for t in params):
        return "BatchNorm tensors of another dtype or device"
    if len({t.dtype for t in params}) > 1:
        return "BatchNorm tensors of mixed dtypes"
    if not y.is_cuda:
        return ""
    from .._loader import build_info

    return "" if build_info().get("cuda", "none") != "none" else "a build without CUDA kernels"
