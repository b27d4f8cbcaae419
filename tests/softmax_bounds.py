"""Per-element error bounds of the softmax family against float64 references, derived from how
the kernels compute: exps of x - max in opmath, a sum of K terms (reference.sum_error), one
division or subtraction, the result rounded once (reference.TOLERANCES)."""

from __future__ import annotations

import torch
from reference import TOLERANCES, sum_error, unit_roundoff


def _finite(t: torch.Tensor) -> torch.Tensor:
    # Terms at +-inf or NaN add nothing to a bound: such outputs must equal the reference exactly.
    return torch.where(t.isfinite(), t, torch.zeros_like(t))


def rounding(expected: torch.Tensor) -> torch.Tensor:
    """The result's own rounding and a few ulps (TOLERANCES), for `expected` in its dtype."""
    atol, rtol = TOLERANCES[expected.dtype]
    return atol + rtol * _finite(expected.double().cpu()).abs()


def forward_bound(scores: torch.Tensor, dim: int, log: bool, expected: torch.Tensor, scores_rounded=False):
    """Bound of softmax (log=False) or log_softmax (log=True) of float64 `scores` along dim.

    An exp in opmath is off by at most 2 + 1.2|v| ulps, u (4 + 2.5|v|) relatively (CUDA's __expf
    and ex2.approx; the CPU's are closer), and d = s - max by u|d| more (u|s| where the scores were
    computed in opmath: scores_rounded); the row's sum S by those errors' sum plus the summation's.
    softmax's y = exp(d) / S inherits both relatively; log_softmax's d - log S both absolutely,
    plus the rounding of d and log S.
    """
    u = unit_roundoff(expected.dtype)
    s = scores.double().cpu()
    if s.numel() == 0:
        return rounding(expected)
    m = s.amax(dim, keepdim=True)
    d = _finite(s - m)
    e = torch.exp(d).masked_fill(~(s - m).isfinite(), 0.0)
    exp_rel = u * (3.5 * d.abs() + 4 + (_finite(s).abs() if scores_rounded else 0))
    S = e.sum(dim, keepdim=True)
    sum_rel = _finite((sum_error(e, dim, expected.dtype) + (e * exp_rel).sum(dim, keepdim=True)) / S)
    if log:
        extra = exp_rel + u * _finite(S.log()).abs() + sum_rel
    else:
        extra = _finite(e / S) * (exp_rel + sum_rel)
    return rounding(expected) + extra


def backward_bound(name: str, g: torch.Tensor, y: torch.Tensor, dim: int, expected: torch.Tensor, scale=1.0):
    """Bound of the fused backward ops, `scale` times dx, for grad g and forward output y.

    softmax: dx = y (g - D), D = sum(g y); log_softmax: dx = g - exp(y) S, S = sum(g). Each
    elementwise step rounds by u times its operands (4u: product, difference, with room; exp(y) by
    u (4 + 2.5|y|), as forward_bound); the sum's error reaches dx times y or exp(y).
    """
    u = unit_roundoff(y.dtype)
    g64, y64 = g.double().cpu(), y.double().cpu()
    if name == "log_softmax":
        p = _finite(torch.exp(y64))
        S = g64.sum(dim, keepdim=True)
        extra = 4 * u * g64.abs() + p * (u * (2.5 * _finite(y64).abs() + 8) * S.abs() + sum_error(g64, dim, y.dtype))
    else:
        D = (g64 * y64).sum(dim, keepdim=True)
        extra = y64.abs() * (4 * u * (g64.abs() + D.abs()) + sum_error(g64 * y64, dim, y.dtype))
    return rounding(expected) + abs(scale) * extra
