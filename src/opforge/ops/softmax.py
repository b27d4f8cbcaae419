"""``softmax``, ``log_softmax`` and ``scaled_masked_softmax``: wrappers, fake
kernels and autograd.

``softmax`` / ``log_softmax`` follow ``torch.softmax`` / ``torch.log_softmax``:
any dim, ``dtype=`` converts the input first, rows of ``-inf`` and rows with
NaN give NaN as in torch, 0-d and empty tensors work.

``scaled_masked_softmax(x, mask, scale, causal)`` is ``softmax(x * scale +
mask)`` over the last dim in one pass. ``mask`` is a bool tensor (True =
masked out) or an additive float mask of x's dtype, broadcastable to x.
``causal=True`` masks key ``j`` for query ``i`` when ``j > i`` (top-left
aligned, as ``torch.ones(Lq, Lk).tril()`` and SDPA's ``is_causal``) without a
mask tensor. A row whose every key is masked (or ``-inf``) gives zeros, not
NaN, and a zero gradient.

Backward passes are ops of their own (``_softmax_backward``,
``_log_softmax_backward``, ``_scaled_masked_softmax_backward``), one fused
pass each.
"""

from __future__ import annotations

import torch

from . import _checks
from ._dispatch import call

_ns = torch.ops.opforge


# --------------------------------------------------------------------------- checks


def _check_dim(op: str, t: torch.Tensor, dim, name: str = "x") -> None:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{op}: dim must be an int, got {type(dim).__name__}")
    n = max(t.dim(), 1)
    if not -n <= dim < n:
        raise IndexError(f"{op}: dim must be in [{-n}, {n - 1}] for a {t.dim()}-d {name}, got {dim}")


def _check_dtype_arg(op: str, dtype) -> None:
    if dtype is not None and dtype not in _checks.FLOAT_DTYPES:
        raise TypeError(f"{op}: dtype must be float32, float64, float16, bfloat16 or None, got {dtype}")


def _check_softmax(op: str, x, dim, dtype) -> None:
    _checks.float_tensor(op, "x", x)
    _check_dtype_arg(op, dtype)
    _check_dim(op, x, dim)


def _check_scaled_masked(op: str, x, mask, scale, causal) -> None:
    _checks.float_tensor(op, "x", x)
    if x.dim() < 1:
        raise ValueError(f"{op}: x must have at least 1 dimension (..., Lk), got a 0-d tensor")
    if isinstance(scale, bool) or not isinstance(scale, (int, float, torch.SymInt, torch.SymFloat)):
        raise TypeError(f"{op}: scale must be a float, got {type(scale).__name__}")
    if not isinstance(causal, bool):
        raise TypeError(f"{op}: causal must be a bool, got {type(causal).__name__}")
    if mask is None:
        return
    _checks.tensor_arg(op, "mask", mask)
    if mask.dtype != torch.bool and mask.dtype != x.dtype:
        raise TypeError(
            f"{op}: mask must be a bool tensor (True = masked out) or an additive float mask of x's dtype "
            f"({x.dtype}), got {mask.dtype}"
        )
    _checks.same_device(op, "x", x, "mask", mask)
    ok = mask.dim() <= x.dim() and all(
        mask.shape[-i] == x.shape[-i] or mask.shape[-i] == 1 for i in range(1, mask.dim() + 1)
    )
    if not ok:
        raise ValueError(
            f"{op}: mask with shape {list(mask.shape)} is not broadcastable to x with shape {list(x.shape)}"
        )


def _check_backward(op: str, grad, output, dim) -> None:
    _checks.float_tensor(op, "grad", grad)
    _checks.float_tensor(op, "output", output)
    if grad.dtype != output.dtype:
        raise TypeError(
            f"{op}: grad and output must have the same dtype, got grad {grad.dtype} and output {output.dtype}"
        )
    _checks.same_device(op, "grad", grad, "output", output)
    if grad.shape != output.shape:
        raise ValueError(
            f"{op}: grad and output must have the same shape, "
            f"got grad {list(grad.shape)} and output {list(output.shape)}"
        )
    _check_dim(op, output, dim, "output")


# --------------------------------------------------------------------------- public ops


def softmax(x: torch.Tensor, dim: int = -1, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.softmax(x, dim, dtype=dtype)`` in one kernel (float32 accumulation).

    >>> import torch, opforge
    >>> opforge.softmax(torch.tensor([[0.0, 0.0], [0.0, float("-inf")]]))
    tensor([[0.5000, 0.5000],
            [1.0000, 0.0000]])
    """
    _check_softmax("opforge.softmax", x, dim, dtype)
    return call(_ns.softmax.default, x, dim, dtype)


def log_softmax(x: torch.Tensor, dim: int = -1, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.log_softmax(x, dim, dtype=dtype)`` in one kernel.

    >>> import torch, opforge
    >>> opforge.log_softmax(torch.zeros(2))
    tensor([-0.6931, -0.6931])
    """
    _check_softmax("opforge.log_softmax", x, dim, dtype)
    return call(_ns.log_softmax.default, x, dim, dtype)


def scaled_masked_softmax(
    x: torch.Tensor, mask: torch.Tensor | None = None, scale: float = 1.0, causal: bool = False
) -> torch.Tensor:
    """``softmax(x * scale + mask, dim=-1)`` in one pass, for attention scores ``(..., Lq, Lk)``.

    ``mask``: bool (True = masked out) or additive, of x's dtype, broadcastable
    to x. ``causal``: query ``i`` sees keys ``j <= i``. Fully masked rows are 0.

    >>> import torch, opforge
    >>> opforge.scaled_masked_softmax(torch.zeros(3, 3), causal=True)
    tensor([[1.0000, 0.0000, 0.0000],
            [0.5000, 0.5000, 0.0000],
            [0.3333, 0.3333, 0.3333]])
    """
    _check_scaled_masked("opforge.scaled_masked_softmax", x, mask, scale, causal)
    return call(_ns.scaled_masked_softmax.default, x, mask, float(scale), causal)


# --------------------------------------------------------------------------- fake kernels


def _empty(shape, dtype, device) -> torch.Tensor:
    # The kernels always return a fresh contiguous tensor.
    return torch.empty(shape, dtype=dtype, device=device)


@torch.library.register_fake("opforge::softmax")
def _softmax_fake(x, dim=-1, dtype=None):
    _check_softmax("opforge.softmax", x, dim, dtype)
    return _empty(x.shape, dtype or x.dtype, x.device)


@torch.library.register_fake("opforge::log_softmax")
def _log_softmax_fake(x, dim=-1, dtype=None):
    _check_softmax("opforge.log_softmax", x, dim, dtype)
    return _empty(x.shape, dtype or x.dtype, x.device)


@torch.library.register_fake("opforge::scaled_masked_softmax")
def _scaled_masked_softmax_fake(x, mask=None, scale=1.0, causal=False):
    _check_scaled_masked("opforge.scaled_masked_softmax", x, mask, scale, causal)
    return _empty(x.shape, x.dtype, x.device)


@torch.library.register_fake("opforge::_softmax_backward")
def _softmax_backward_fake(grad, output, dim):
    _check_backward("opforge._softmax_backward", grad, output, dim)
    return _empty(output.shape, output.dtype, output.device)


@torch.library.register_fake("opforge::_log_softmax_backward")
def _log_softmax_backward_fake(grad, output, dim):
    _check_backward("opforge._log_softmax_backward", grad, output, dim)
    return _empty(output.shape, output.dtype, output.device)


@torch.library.register_fake("opforge::_scaled_masked_softmax_backward")
def _scaled_masked_softmax_backward_fake(grad, output, scale):
    _check_backward("opforge._scaled_masked_softmax_backward", grad, output, -1)
    return _empty(output.shape, output.dtype, output.device)


# --------------------------------------------------------------------------- autograd


def _softmax_setup(ctx, inputs, output):
    x, dim, _ = inputs
    ctx.dim = dim
    ctx.x_dtype = x.dtype
    ctx.save_for_backward(output)


def _softmax_bwd(ctx, grad):
    (y,) = ctx.saved_tensors
    gx = _ns._softmax_backward.default(grad.to(y.dtype), y, ctx.dim)
    return gx.to(ctx.x_dtype), None, None


def _log_softmax_bwd(ctx, grad):
    (y,) = ctx.saved_tensors
    gx = _ns._log_softmax_backward.default(grad.to(y.dtype), y, ctx.dim)
    return gx.to(ctx.x_dtype), None, None


def _scaled_masked_setup(ctx, inputs, output):
    _, mask, scale, _ = inputs
    ctx.scale = scale
    ctx.mask_meta = (mask.shape, mask.dtype) if mask is not None else None
    ctx.save_for_backward(output)


def _scaled_masked_bwd(ctx, grad):
    (y,) = ctx.saved_tensors
    grad = grad.to(y.dtype)
    gx = _ns._scaled_masked_softmax_backward.default(grad, y, ctx.scale) if ctx.needs_input_grad[0] else None
    gmask = None
    if ctx.mask_meta is not None and ctx.needs_input_grad[1]:
        # d/d(mask) of softmax(x * scale + mask) is the unscaled softmax backward.
        shape, dtype = ctx.mask_meta
        gmask = _ns._scaled_masked_softmax_backward.default(grad, y, 1.0).sum_to_size(shape).to(dtype)
    return gx, gmask, None, None


torch.library.register_autograd("opforge::softmax", _softmax_bwd, setup_context=_softmax_setup)
torch.library.register_autograd("opforge::log_softmax", _log_softmax_bwd, setup_context=_softmax_setup)
torch.library.register_autograd(
    "opforge::scaled_masked_softmax", _scaled_masked_bwd, setup_context=_scaled_masked_setup
)


# Second derivatives: the backward ops' own gradients, composed from torch ops
# (they are rarely hot). With u the incoming gradient of grad_in:
#   softmax:     grad_in = y * (g - s), s = sum(g * y)
#                d/dg = softmax_backward(u, y);  d/dy = u * (g - s) - g * sum(u * y)
#   log_softmax: grad_in = g - exp(y) * sum(g)
#                d/dg = u - sum(u * exp(y));     d/dy = -u * exp(y) * sum(g)


def _bwd_setup(ctx, inputs, output):
    grad, y, third = inputs
    ctx.third = third
    ctx.save_for_backward(grad, y)


def _softmax_backward_grad_y(u, g, y, dim):
    """d/dy of <u, y * (g - sum(g * y))>: the double backward's gradient for y."""
    return u * (g - (g * y).sum(dim, keepdim=True)) - g * (u * y).sum(dim, keepdim=True)


def _softmax_backward_bwd(ctx, u):
    g, y = ctx.saved_tensors
    dim = ctx.third
    gg = _ns._softmax_backward.default(u, y, dim) if ctx.needs_input_grad[0] else None
    gy = _softmax_backward_grad_y(u, g, y, dim) if ctx.needs_input_grad[1] else None
    return gg, gy, None


def _log_softmax_backward_bwd(ctx, u):
    g, y = ctx.saved_tensors
    dim = ctx.third
    e = torch.exp(y)
    gg = (u - (u * e).sum(dim, keepdim=True)) if ctx.needs_input_grad[0] else None
    gy = (-u * e * g.sum(dim, keepdim=True)) if ctx.needs_input_grad[1] else None
    return gg, gy, None


def _scaled_masked_backward_bwd(ctx, u):
    g, y = ctx.saved_tensors
    scale = ctx.third
    gg = _ns._scaled_masked_softmax_backward.default(u, y, scale) if ctx.needs_input_grad[0] else None
    gy = _softmax_backward_grad_y(u, g, y, -1) * scale if ctx.needs_input_grad[1] else None
    return gg, gy, None


torch.library.register_autograd("opforge::_softmax_backward", _softmax_backward_bwd, setup_context=_bwd_setup)
torch.library.register_autograd("opforge::_log_softmax_backward", _log_softmax_backward_bwd, setup_context=_bwd_setup)
torch.library.register_autograd(
    "opforge::_scaled_masked_softmax_backward", _scaled_masked_backward_bwd, setup_context=_bwd_setup
)
