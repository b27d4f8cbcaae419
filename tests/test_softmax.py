"""opforge.softmax / log_softmax / scaled_masked_softmax and their fused backward ops: values against float64."""

import os

import pytest
import torch
from cpu_isa import run_capped
from reference import DTYPES, assert_close, poisoned, rand
from softmax_check import (
    BWD_OPS,
    INF,
    NAN,
    OPS,
    ROW_LENGTHS,
    SHAPES,
    check,
    check_bwd,
    check_fwd,
    check_smsm,
    make_mask,
)

import opforge


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,dim", SHAPES)
def test_values(name, dtype, shape, dim, device):
    check(name, rand(shape, dtype, device, scale=3.0), dim)


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K", ROW_LENGTHS)
def test_row_lengths(name, dtype, K, device):
    check(name, rand((3, K), dtype, device, scale=4.0), -1)


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_very_long_row(name, dtype, device):
    check(name, rand((1, 300000), dtype, device, scale=5.0), -1)


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_many_short_rows_and_outer_dims(name, dtype, device):
    check(name, rand((4097, 128), dtype, device), -1)
    check(name, rand((3, 2000, 7), dtype, device), 1)
    check(name, rand((300, 2, 65), dtype, device), 0)
    check(name, rand((20, 33000), dtype, device), 0)  # many columns: a thread per column on CUDA


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_non_contiguous(name, dtype, device):
    base = rand((64, 48), dtype, device, scale=2.0)
    check(name, base.t(), -1)  # transposed
    check(name, base.t(), 0)
    check(name, base[::2, 1::3], -1)  # sliced
    check(name, base[:, 1:], -1)  # misaligned start
    check(name, rand((1, 48), dtype, device).expand(64, 48), -1)  # zero stride
    check(name, rand((6, 5, 4), dtype, device).permute(2, 0, 1), 1)


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dtype_argument(name, dtype, device):
    x = rand((5, 37), torch.float16, device)
    out = check(name, x, -1, dtype=dtype)
    assert out.dtype == dtype
    # dtype= on the backward: the input's gradient keeps the input's dtype.
    x = x.requires_grad_()
    OPS[name][0](x, -1, torch.float32).sum().backward()
    assert x.grad.dtype == torch.float16


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K", [5, 40, 3000, 100000])
def test_inf_and_nan_as_torch(name, dtype, K, device):
    x = rand((7, K), dtype, device)
    x[0] = -INF  # all -inf: NaN, as torch
    x[1, : K // 2 + 1] = -INF  # the first half (first chunks) -inf
    x[2, K // 3] = NAN  # NaN propagates to the row
    x[3, K - 1] = INF  # +inf: NaN, as torch
    x[4, ::2] = -INF  # scattered -inf
    x[5, 0] = 1000.0  # one dominant value
    check(name, x, -1, equal_nan=True)
    check(name, x.t().contiguous(), 0, equal_nan=True)


def last_level_cache_bytes():
    """The last-level cache one core sees, as the CPU kernels read it (32 MiB where unknown)."""
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index3/size") as f:
            text = f.read().strip()
        if text.endswith("K"):
            return int(text[:-1]) << 10
    except (OSError, ValueError):
        pass
    return 32 << 20


@pytest.mark.parametrize("K", [128, 1000, 2048])
def test_cpu_float32_streamed_output(K):
    # Input and output together past the last-level cache: the float32
    # forward writes y with streaming stores (rows up to 2048). K = 1000
    # leaves most rows starting off a cache line and a tail past the last
    # full vector.
    rows = last_level_cache_bytes() // (4 * K) + 3
    x = rand((rows, K), torch.float32, "cpu", scale=3.0)
    x[1, 7] = float("-inf")
    with poisoned("cpu"):
        out = opforge.softmax(x, -1)
    assert out.is_contiguous()
    # Checked 8 MB of rows at a time: some machines report an LLC of hundreds of MB, and the
    # float64 reference and its bound of the whole tensor would take many times that.
    step = max(1, (8 << 20) // (4 * K))
    for begin in range(0, rows, step):
        check_fwd("softmax", out[begin : begin + step], x[begin : begin + step], -1)


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("K", [16, 1000, 8192])
def test_exp_range(name, dtype, K, device):
    # x - max spanning 0 down to -130: exp of every magnitude a float32 holds,
    # the denormal range (below -87.3) and underflow to 0, in one row.
    x = torch.linspace(0.0, -130.0, K).repeat(4, 1)
    x[1] = x[1].flip(0) + 50.0
    x[2] = x[2][torch.randperm(K)]
    x[3, ::3] = -INF
    check(name, x.to(dtype).to(device), -1)


def correctly_rounded(out, x):
    """The fraction of `out` equal to the float64 softmax of `x` rounded to out's dtype."""
    expected = torch.softmax(x.double().cpu(), -1).to(out.dtype)
    return (out.cpu() == expected).double().mean().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("K", [40, 128, 1000, 8192])
def test_half_outputs_round_correctly(dtype, K, device):
    # Half-type outputs are rounded once from float32 arithmetic: all but a
    # few per thousand must be the correctly rounded result (the exps'
    # polynomial error must stay far below the dtype's rounding), and none
    # off by more than the tolerance.
    x = rand((64, K), torch.float32, device, scale=3.0).to(dtype)
    out = check("softmax", x, -1)
    assert correctly_rounded(out, x) >= 0.998


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K", [7, 1000, 40000, 300000])
@pytest.mark.parametrize("offset", [1000.0, -20000.0])
def test_offset_rows(name, dtype, K, offset, device):
    # Logits far from 0: the results are those of the unshifted rows, so
    # nothing may round at the max's magnitude (log_softmax's x - m - log sum
    # as (x - m) - log sum; the exps' scaled max in base 2).
    x = (rand((3, K), torch.float32, device, scale=3.0) + offset).to(dtype)
    check(name, x, -1)


@pytest.mark.parametrize("capability", ["default", "avx2", "avx512"])
def test_every_cpu_isa_build(capability):
    # Each ISA's loops are separate machine code with their own exp and
    # conversions (AVX2's half types: a polynomial exp and bfloat16 chunks
    # in an order of their own), picked the way torch picks its own
    # (ATEN_CPU_CAPABILITY caps the choice): every dtype, short rows in
    # groups and alone, ragged tails, long rows, -inf and NaN rows, the
    # fused backward ops and both mask kinds.
    code = """
import torch, opforge
from reference import assert_within
from softmax_bounds import backward_bound, forward_bound
for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
    for K in (1, 7, 40, 128, 1000, 1031, 5000):
        x = (torch.randn(9, K, dtype=torch.float64) * 3).to(dtype)
        x[1, ::3] = -float("inf")
        x[6, K // 2] = float("nan")
        x[7] = -float("inf")
        for ours, theirs in ((opforge.softmax, torch.softmax), (opforge.log_softmax, torch.log_softmax)):
            expected = theirs(x.double(), -1).to(dtype)
            log = ours is opforge.log_softmax
            assert_within(ours(x, -1), expected, forward_bound(x.double(), -1, log, expected), equal_nan=True)
            assert_within(
                ours(x.t(), 0), expected.t(), forward_bound(x.t().double(), 0, log, expected.t()), equal_nan=True
            )
        # the fused backward ops
        x, g = (torch.randn(6, K, dtype=torch.float64) * 3 for _ in range(2))
        y = torch.softmax(x, -1).to(dtype)
        expected = torch._softmax_backward_data(g.to(dtype).double(), y.double(), -1, torch.float64).to(dtype)
        assert_within(
            torch.ops.opforge._softmax_backward(g.to(dtype), y, -1),
            expected,
            backward_bound("softmax", g.to(dtype), y, -1, expected),
        )
        y = torch.log_softmax(x, -1).to(dtype)
        expected = torch._log_softmax_backward_data(g.to(dtype).double(), y.double(), -1, torch.float64).to(dtype)
        assert_within(
            torch.ops.opforge._log_softmax_backward(g.to(dtype), y, -1),
            expected,
            backward_bound("log_softmax", g.to(dtype), y, -1, expected),
        )
        # scaled_masked_softmax with a bool and an additive mask (no row fully masked)
        xs = x.to(dtype)
        keep = torch.rand(6, K) < 0.7
        keep[:, 0] = True
        for mask, add in (
            (~keep, torch.zeros(6, K).masked_fill(~keep, -float("inf"))),
            (torch.randn(6, K).to(dtype), None),
        ):
            add = mask.double() if add is None else add.double()
            scores = xs.double() * 0.37 + add
            expected = torch.softmax(scores, -1).to(dtype)
            bound = forward_bound(scores, -1, False, expected, scores_rounded=True)
            assert_within(opforge.scaled_masked_softmax(xs, mask, 0.37), expected, bound)
    if dtype in (torch.float16, torch.bfloat16):
        x = (torch.randn(64, 1000) * 3).to(dtype)
        assert (opforge.softmax(x, -1) == torch.softmax(x.double(), -1).to(dtype)).double().mean() >= 0.998, dtype
print("ok")
"""
    # The subprocess imports the same bounds as the tests here.
    run_capped(capability, f"import sys\nsys.path.insert(0, {os.path.dirname(__file__)!r})\n" + code)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["none", "bool", "float"])
@pytest.mark.parametrize(
    "xs,ms",
    [
        ((2, 3, 5, 7), (2, 3, 5, 7)),  # full mask
        ((2, 3, 5, 7), (1, 3, 1, 7)),  # broadcast over batch and queries
        ((2, 3, 5, 7), (5, 7)),  # broadcast over batch and heads
        ((2, 3, 5, 7), (2, 1, 1, 7)),  # key padding mask
        ((2, 3, 5, 7), (7,)),
        ((4, 33, 1000), (4, 1, 1000)),
        ((2, 4, 4104), (4, 4104)),
        ((2, 40000), (1, 40000)),  # split rows on CUDA
    ],
)
def test_scaled_masked_values(dtype, kind, xs, ms, device):
    x = rand(xs, dtype, device, scale=3.0)
    check_smsm(x, make_mask(kind, ms, dtype, device), scale=0.37)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lq,lk", [(6, 6), (4, 9), (9, 4), (1, 5), (5, 1), (64, 1031), (40, 2048), (3, 70000)])
@pytest.mark.parametrize("with_mask", [False, True])
def test_causal(dtype, lq, lk, with_mask, device):
    x = rand((2, lq, lk), dtype, device, scale=2.0)
    mask = (torch.rand((lq, lk), device=device) < 0.2) if with_mask else None
    out = check_smsm(x, mask, scale=1.5, causal=True)
    # Top-left alignment: query i sees keys 0..i.
    above = torch.ones(lq, lk, dtype=torch.bool, device=device).triu(1)
    assert (out[:, above] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lk", [7, 1000, 8192, 40000])
def test_fully_masked_rows_are_zero(dtype, lk, device):
    x = rand((3, 4, lk), dtype, device)
    mask = torch.zeros((3, 4, lk), dtype=torch.bool, device=device)
    mask[0] = True  # every row of batch 0 masked
    mask[1, 2] = True
    mask[2, :, : lk // 2 + 1] = True
    out = check_smsm(x, mask, scale=0.5)
    assert (out[0] == 0).all() and (out[1, 2] == 0).all()
    # -inf scores and an additive -inf mask count as masked too.
    x[2, 1] = -INF
    fmask = torch.zeros((lk,), dtype=dtype, device=device)
    fmask[: lk // 3] = -INF
    out = check_smsm(x, fmask, scale=2.0)
    assert (out[2, 1] == 0).all()
    # Gradient of a fully masked row is zero.
    xg = x.detach().clone().requires_grad_()
    opforge.scaled_masked_softmax(xg, mask).backward(rand(x.shape, dtype, device))
    assert (xg.grad[0] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scaled_masked_nan_propagates_and_strides(dtype, device):
    x = rand((3, 6, 50), dtype, device)
    x[1, 2, 7] = NAN
    check_smsm(x, None, 0.5, equal_nan=True)
    base = rand((8, 50, 6), dtype, device)
    mask = torch.rand((50, 6), device=device) < 0.3
    check_smsm(base.transpose(1, 2), mask.t(), 1.25)  # non-contiguous x and mask
    check_smsm(base[:, 1:, 1:], None, 1.0, causal=True)


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_mask_layouts(kind, device):
    # The mask's rows are addressed through its own strides (0 where it
    # broadcasts): more independent broadcast dims than the row map holds
    # (8), a mask broadcast along the keys, a 0-d mask, a transposed one.
    cases = [
        ((2,) * 10 + (5,), (2, 1) * 5 + (5,)),
        ((3, 4, 6), (3, 4, 1)),
        ((3, 4, 6), ()),
        ((2, 5, 4), (4, 5)),  # transposed below
    ]
    for xs, ms in cases:
        x = rand(xs, torch.float32, device, scale=2.0)
        mask = make_mask(kind, ms, torch.float32, device)
        if ms == (4, 5):
            mask = mask.t()
        if kind == "bool" and mask.dim() > 0:
            mask[..., 0] = False  # no fully masked rows
        elif kind == "bool":
            mask = torch.tensor(False, device=device)
        check_smsm(x, mask, scale=0.75)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_scaled_masked_softmax_matches_torch_composition(dtype, device):
    x = rand((2, 3, 16, 16), dtype, device)
    mask = torch.rand((16, 16), device=device) < 0.25
    mask.fill_diagonal_(False)
    additive = torch.zeros((16, 16), dtype=dtype, device=device).masked_fill(mask, -INF)
    expected = torch.softmax(x * 0.125 + additive, -1)
    torch.testing.assert_close(opforge.scaled_masked_softmax(x, mask, 0.125), expected)
    torch.testing.assert_close(opforge.scaled_masked_softmax(x, additive, 0.125), expected)


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape,dim",
    [((7, 33), -1), ((4, 5, 6), 1), ((4, 5, 6), 0), ((6, 1), -1), ((0, 3), -1), ((2, 130, 3), 1), ((20, 33000), 0)],
)
def test_backward_op_values(name, dtype, shape, dim, device):
    y = OPS[name][0](rand(shape, dtype, device), dim)
    g = rand(shape, dtype, device)
    with poisoned(device):
        out = BWD_OPS[name](g, y, dim)
    check_bwd(name, out, g, y, dim)


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K", [1, 33, 1024, 4104, 16384, 16392, 40000, 100003])
def test_backward_row_lengths(name, dtype, K, device):
    y = OPS[name][0](rand((3, K), dtype, device, scale=2.0), -1)
    g = rand((3, K), dtype, device)
    with poisoned(device):
        out = BWD_OPS[name](g, y, -1)
    check_bwd(name, out, g, y, -1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K", [7, 2048, 40000, 300000])
def test_scaled_masked_backward_op(dtype, K, device):
    y = opforge.scaled_masked_softmax(rand((2, 3, K), dtype, device), causal=True)
    g = rand(y.shape, dtype, device)
    with poisoned(device):
        out = torch.ops.opforge._scaled_masked_softmax_backward(g, y, 0.75)
    check_bwd("softmax", out, g, y, -1, scale=0.75)


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("shape,dim", [((3, 5), -1), ((3, 4, 5), 1), ((4, 3), 0), ((1,), 0)])
def test_gradcheck(name, shape, dim, device):
    fn = OPS[name][0]
    x = rand(shape, torch.float64, device).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: fn(t, dim), (x,))
    assert torch.autograd.gradgradcheck(lambda t: fn(t, dim), (x,))


@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck_scaled_masked(causal, device):
    x = rand((2, 4, 5), torch.float64, device).requires_grad_()
    bmask = torch.rand((4, 5), device=device) < 0.3
    bmask[:, 0] = False
    fmask = rand((1, 4, 5), torch.float64, device).requires_grad_()  # the additive mask's gradient too
    assert torch.autograd.gradcheck(lambda t: opforge.scaled_masked_softmax(t, bmask, 0.7, causal), (x,))
    assert torch.autograd.gradcheck(lambda t, m: opforge.scaled_masked_softmax(t, m, 0.7, causal), (x, fmask))
    assert torch.autograd.gradgradcheck(lambda t: opforge.scaled_masked_softmax(t, bmask, 0.7, causal), (x,))


@pytest.mark.parametrize("dtype", DTYPES)
def test_autograd_matches_torch(dtype, device):
    x = rand((4, 6, 40), dtype, device).requires_grad_()
    g = rand((4, 6, 40), dtype, device)
    x64 = x.detach().double().requires_grad_()
    for ours, theirs in [
        (lambda t: opforge.softmax(t, 1), lambda t: torch.softmax(t, 1)),
        (lambda t: opforge.log_softmax(t, -1), lambda t: torch.log_softmax(t, -1)),
        (lambda t: opforge.scaled_masked_softmax(t, None, 0.5, True), lambda t: ref_smsm_diff(t, 0.5)),
    ]:
        x.grad = x64.grad = None
        ours(x).backward(g)
        theirs(x64).backward(g.double())
        assert x.grad.dtype == dtype
        assert_close(x.grad.cpu(), x64.grad.cpu().to(dtype), scale=4.0)


def ref_smsm_diff(t, scale):
    lq, lk = t.shape[-2:]
    above = torch.ones(lq, lk, dtype=torch.bool, device=t.device).triu(1)
    return torch.softmax((t * scale).masked_fill(above, -INF), -1)
