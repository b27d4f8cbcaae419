"""The softmax family's references and value checks against float64, shared by its tests."""

import torch
from reference import assert_within, poisoned, rand
from softmax_bounds import backward_bound, forward_bound

import opforge

INF = float("inf")
NAN = float("nan")
OPS = {
    "softmax": (opforge.softmax, torch.softmax),
    "log_softmax": (opforge.log_softmax, torch.log_softmax),
}
BWD_OPS = {"softmax": torch.ops.opforge._softmax_backward, "log_softmax": torch.ops.opforge._log_softmax_backward}

# (shape, dim): inner-most, middle, first, negative dims, length-1 rows, 0-d, empty.
SHAPES = [
    ((7, 33), -1),
    ((4, 5, 6), 1),
    ((4, 5, 6), 0),
    ((4, 5, 6), -2),
    ((3, 8, 17), 2),
    ((6, 1), -1),
    ((1, 6), 0),
    ((), 0),
    ((), -1),
    ((5,), 0),
    ((0, 4), -1),
    ((4, 0), -1),
    ((2, 0, 3), 1),
    ((2, 130, 3), 1),
]

# Row lengths that cross every CUDA path boundary (sub-warp, warp, block,
# split into chunks), with and without a multiple of the vector width.
ROW_LENGTHS = [
    1,
    2,
    3,
    8,
    31,
    32,
    33,
    127,
    128,
    255,
    1000,
    1024,
    1031,
    2048,
    4104,
    8192,
    16384,
    32768,
    32776,
    70001,
    100000,
]


def ref(name, x, dim, dtype=None):
    out_dtype = dtype or x.dtype
    return OPS[name][1](x.to(out_dtype).double().cpu(), dim).to(out_dtype)


def check(name, x, dim, dtype=None, equal_nan=False):
    with poisoned(x.device):
        out = OPS[name][0](x, dim, dtype)
    assert out.device == x.device and out.is_contiguous()
    check_fwd(name, out, x, dim, dtype, equal_nan)
    return out


def check_fwd(name, out, x, dim, dtype=None, equal_nan=False):
    """`out` against the float64 result, within the bound derived from the row's length and values."""
    expected = ref(name, x, dim, dtype)
    scores = x.to(expected.dtype).double().cpu()
    assert_within(out.cpu(), expected, forward_bound(scores, dim, name == "log_softmax", expected), equal_nan)


def ref_smsm(x, mask=None, scale=1.0, causal=False):
    s = smsm_scores(x, mask, scale, causal)
    y = torch.softmax(s, -1)
    dead = (s == -INF).all(-1, keepdim=True)
    return torch.where(dead, torch.zeros_like(y), y).to(x.dtype)


def smsm_scores(x, mask=None, scale=1.0, causal=False):
    s = x.double().cpu() * scale
    if mask is not None:
        m = mask.cpu()
        s = s.masked_fill(m, -INF) if m.dtype == torch.bool else s + m.double()
    if causal:
        lq, lk = s.shape[-2] if s.dim() >= 2 else 1, s.shape[-1]
        above = torch.ones(lq, lk, dtype=torch.bool).triu(1)
        s = s.masked_fill(above, -INF)
    return s


def check_smsm(x, mask=None, scale=1.0, causal=False, equal_nan=False):
    with poisoned(x.device):
        out = opforge.scaled_masked_softmax(x, mask, scale, causal)
    expected = ref_smsm(x, mask, scale, causal)
    # x * scale + mask is rounded in opmath before the exps (scores_rounded).
    bound = forward_bound(smsm_scores(x, mask, scale, causal), -1, False, expected, scores_rounded=True)
    assert_within(out.cpu(), expected, bound, equal_nan)
    return out


def make_mask(kind, shape, dtype, device):
    if kind == "none":
        return None
    if kind == "bool":
        return torch.rand(shape, device=device) < 0.3
    return rand(shape, dtype, device)  # additive


def ref_bwd(name, g, y, dim, scale=1.0):
    g64, y64 = g.double().cpu(), y.double().cpu()
    if name == "log_softmax":
        return ((g64 - torch.exp(y64) * g64.sum(dim, keepdim=True)) * scale).to(y.dtype)
    return (y64 * (g64 - (g64 * y64).sum(dim, keepdim=True)) * scale).to(y.dtype)


def check_bwd(name, out, g, y, dim, scale=1.0):
    """A fused backward's `out` (scale times dx) against float64, within the derived bound."""
    expected = ref_bwd(name, g, y, dim, scale)
    assert_within(out.cpu(), expected, backward_bound(name, g, y, dim, expected, scale))
