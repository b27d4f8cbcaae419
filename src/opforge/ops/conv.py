"""``conv2d_3x3``: 3x3 convolution with the bias and ReLU fused, forward and backward.

``conv2d_3x3(x, weight, bias, stride, padding, groups, activation)`` equals
``F.conv2d(x, weight, bias, stride, padding, groups=groups)`` followed by
``torch.relu`` when ``activation == "relu"``, computed in one kernel per
output element (the bias and the ReLU are applied before the single store).

- ``x``: ``(N, C, H, W)``, contiguous or channels_last (anything else takes
  one ``.contiguous()`` in its suggested memory format); the output has x's
  memory format.
- ``weight``: ``(K, C / groups, 3, 3)``; ``groups`` is 1 (dense) or ``C``
  (depthwise, ``K`` a multiple of ``C``: channel multiplier ``K / C``).
- ``stride`` 1 or 2, ``padding`` 0 or 1 (zeros), dilation 1.
- float32 / float64 / float16 / bfloat16; half types accumulate in float32.
  On CUDA the dense float32 path follows ``torch.backends.cudnn.allow_tf32``
  exactly as ``F.conv2d`` does; the depthwise path always computes in float32.

Backward is the op ``_conv2d_3x3_backward`` (grad x, grad weight, grad bias
with the ReLU mask ``result > 0`` fused in); double backward raises.
"""

from __future__ import annotations

import torch

from . import _checks
from ._dispatch import call

_ns = torch.ops.opforge
_OP = "opforge.conv2d_3x3"
_BWD = "opforge._conv2d_3x3_backward"


def _check(op: str, x, weight, bias, stride, padding, groups) -> tuple[int, int, int, int]:
    """Checks the arguments; returns the output shape (N, K, Ho, Wo)."""
    _checks.float_tensor(op, "x", x)
    _checks.float_tensor(op, "weight", weight)
    if x.dim() != 4:
        raise ValueError(f"{op}: x must be a 4-d tensor, got {x.dim()}-d with shape {list(x.shape)}")
    if weight.dim() != 4:
        raise ValueError(f"{op}: weight must be a 4-d tensor, got {weight.dim()}-d with shape {list(weight.shape)}")
    if weight.shape[2] != 3 or weight.shape[3] != 3:
        raise ValueError(
            f"{op}: weight must have a 3x3 kernel (shape (K, C/groups, 3, 3)), got shape {list(weight.shape)}"
        )
    _checks.same_device(op, "x", x, "weight", weight)
    if x.dtype != weight.dtype:
        raise TypeError(f"{op}: x and weight must have the same dtype, got x {x.dtype} and weight {weight.dtype}")
    for name, value in (("stride", stride), ("padding", padding), ("groups", groups)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{op}: {name} must be an int, got {type(value).__name__}")
    if stride not in (1, 2):
        raise ValueError(f"{op}: stride must be 1 or 2, got {stride}")
    if padding not in (0, 1):
        raise ValueError(f"{op}: padding must be 0 or 1, got {padding}")
    n, c, h, w = x.shape
    k = weight.shape[0]
    if groups != 1 and (groups != c or c == 0):
        raise ValueError(f"{op}: groups must be 1 or the number of input channels ({c}), got {groups}")
    if weight.shape[1] * groups != c:
        raise ValueError(
            f"{op}: weight must have C/groups = {c // groups} input channels (dim 1) for x with {c} channels "
            f"and groups={groups}, got weight shape {list(weight.shape)}"
        )
    if k < 1 or k % groups != 0:
        raise ValueError(f"{op}: weight's output channels ({k}) must be a positive multiple of groups ({groups})")
    if bias is not None:
        _checks.companion(op, "bias", bias, "x", x)
        if bias.dim() != 1 or bias.shape[0] != k:
            raise ValueError(f"{op}: bias must have shape [{k}], got {list(bias.shape)}")
    if h + 2 * padding < 3 or w + 2 * padding < 3:
        raise ValueError(f"{op}: x's spatial size ({h}, {w}) with padding {padding} is smaller than the 3x3 kernel")
    # No input channels: no output channels, F.conv2d's empty-input rule (csrc/conv.h out_channels).
    k_out = 0 if c == 0 else k
    return n, k_out, (h + 2 * padding - 3) // stride + 1, (w + 2 * padding - 3) // stride + 1


def _activation(activation) -> bool:
    if activation is None:
        return False
    if activation == "relu":
        return True
    raise ValueError(f"{_OP}: activation must be None or 'relu', got {activation!r}")


def conv2d_3x3(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: int = 1,
    padding: int = 0,
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
    relu = _activation(activation)
    _check(_OP, x, weight, bias, stride, padding, groups)
    return call(_ns.conv2d_3x3.default, x, weight, bias, stride, padding, groups, relu)


# --------------------------------------------------------------------------- fake kernels


def _out_format(x: torch.Tensor) -> torch.memory_format:
    # Mirrors csrc/conv.h out_format: x's suggested memory format.
    if x.dim() == 4 and torch._prims_common.suggest_memory_format(x) == torch.channels_last:
        return torch.channels_last
    return torch.contiguous_format


@torch.library.register_fake("opforge::conv2d_3x3")
def _conv2d_3x3_fake(x, weight, bias, stride, padding, groups, relu):
    n, k, ho, wo = _check(_OP, x, weight, bias, stride, padding, groups)
    return x.new_empty((n, k, ho, wo)).contiguous(memory_format=_out_format(x))


def _check_backward(grad_out, result, x, weight, stride, padding, groups):
    shape = _check(_BWD, x, weight, None, stride, padding, groups)
    _checks.companion(_BWD, "grad_out", grad_out, "x", x)
    if tuple(grad_out.shape) != tuple(shape):
        raise ValueError(f"{_BWD}: grad_out must have shape {list(shape)}, got {list(grad_out.shape)}")
    if result is not None:
        _checks.companion(_BWD, "result", result, "x", x)
        if result.shape != grad_out.shape:
            raise ValueError(
                f"{_BWD}: result must have grad_out's shape {list(grad_out.shape)}, got {list(result.shape)}"
            )
    return shape


@torch.library.register_fake("opforge::_conv2d_3x3_backward")
def _conv2d_3x3_backward_fake(grad_out, result, x, weight, stride, padding, groups, output_mask):
    _check_backward(grad_out, result, x, weight, stride, padding, groups)
    empty = x.new_empty((0,))
    gx = torch.empty_like(x, memory_format=_out_format(x)) if output_mask[0] else empty
    gw = torch.empty_like(weight, memory_format=torch.contiguous_format) if output_mask[1] else x.new_empty((0,))
    gb = x.new_empty((weight.shape[0],)) if output_mask[2] else x.new_empty((0,))
    return gx, gw, gb


# --------------------------------------------------------------------------- autograd


def _setup(ctx, inputs, output):
    x, weight, bias, stride, padding, groups, relu = inputs
    ctx.params = (stride, padding, groups)
    ctx.has_bias = bias is not None
    ctx.save_for_backward(x, weight, output if relu else None)


def _backward(ctx, grad):
    x, weight, result = ctx.saved_tensors
    stride, padding, groups = ctx.params
    need = ctx.needs_input_grad
    mask = [bool(need[0]), bool(need[1]), bool(need[2]) and ctx.has_bias]
    if not any(mask):
        return None, None, None, None, None, None, None
    gx, gw, gb = _ns._conv2d_3x3_backward.default(grad, result, x, weight, stride, padding, groups, mask)
    return (gx if mask[0] else None, gw if mask[1] else None, gb if mask[2] else None, None, None, None, None)


def _backward_setup(ctx, inputs, output):
    pass


def _double_backward(ctx, *grads):
    raise NotImplementedError(
        f"{_OP}: double backward (gradients of gradients) is not supported; use torch.nn.functional.conv2d "
        "where second derivatives are needed"
    )


torch.library.register_autograd("opforge::conv2d_3x3", _backward, setup_context=_setup)
torch.library.register_autograd("opforge::_conv2d_3x3_backward", _double_backward, setup_context=_backward_setup)
