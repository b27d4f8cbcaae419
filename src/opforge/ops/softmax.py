"""``softmax``, ``log_softmax`` and ``scaled_masked_softmax``: the public wrappers.

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

Checks, shape functions and autograd are C++ (csrc/softmax_host.h,
csrc/softmax.cpp, csrc/softmax_autograd.cpp); the wrappers only name the
arguments, so a call costs what ``torch.ops.opforge.softmax`` costs.
"""

from __future__ import annotations

import torch

# One overload each: bound once, called directly.
_softmax = torch.ops.opforge.softmax.default
_log_softmax = torch.ops.opforge.log_softmax.default
_scaled_masked_softmax = torch.ops.opforge.scaled_masked_softmax.default


def softmax(x: torch.Tensor, dim: int = -1, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.softmax(x, dim, dtype=dtype)`` in one kernel (float32 accumulation).

    >>> import torch, opforge
    >>> opforge.softmax(torch.tensor([[0.0, 0.0], [0.0, float("-inf")]]))
    tensor([[0.5000, 0.5000],
            [1.0000, 0.0000]])
    """
    return _softmax(x, dim, dtype)


def log_softmax(x: torch.Tensor, dim: int = -1, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.log_softmax(x, dim, dtype=dtype)`` in one kernel.

    >>> import torch, opforge
    >>> opforge.log_softmax(torch.zeros(2))
    tensor([-0.6931, -0.6931])
    """
    return _log_softmax(x, dim, dtype)


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
    return _scaled_masked_softmax(x, mask, scale, causal)
