"""opforge.softmax / log_softmax / scaled_masked_softmax and their fused backward ops."""

import os

import pytest
import torch
from cpu_isa import run_capped
from reference import DTYPES, assert_close, assert_within, poisoned, rand
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
    check("softmax", x, -1)


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


# --------------------------------------------------------------------------- scaled_masked_softmax


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


# --------------------------------------------------------------------------- errors

# Every check lives once, in C++ (csrc/softmax_host.h): the public wrapper,
# the op itself and the shape function (meta tensors, as under
# torch.compile) raise the same exception with the same words.


def on_meta(args):
    return [a.to("meta") if isinstance(a, torch.Tensor) else a for a in args]


def raises_everywhere(fns, args, exc, match):
    """`exc` matching `match` from each of `fns` (wrapper and op) on real and on meta tensors."""
    for fn in fns:
        for call_args in (args, on_meta(args)):
            with pytest.raises(exc, match=match):
                fn(*call_args)


def softmax_bad_inputs(op):
    x2 = torch.randn(2, 3)
    return [
        (
            (torch.arange(3),),
            TypeError,
            rf"{op}: x must be a float32, float64, float16 or bfloat16 tensor, got torch.int64",
        ),
        ((x2, 2), IndexError, rf"{op}: dim must be in \[-2, 1\] for a 2-d x, got 2"),
        ((x2, -3), IndexError, rf"{op}: dim must be in \[-2, 1\] for a 2-d x, got -3"),
        ((torch.randn(()), -2), IndexError, rf"{op}: dim must be in \[-1, 0\] for a 0-d x, got -2"),
        (
            (torch.randn(3), 0, torch.int32),
            TypeError,
            rf"{op}: dtype must be float32, float64, float16, bfloat16 or None, got torch.int32",
        ),
        # dtype= is checked before dim, as torch converts first.
        ((torch.randn(3), 5, torch.int64), TypeError, rf"{op}: dtype must be .* got torch.int64"),
    ]


@pytest.mark.parametrize("name", OPS)
def test_bad_inputs_raise_clear_errors(name):
    fns = (OPS[name][0], getattr(torch.ops.opforge, name), getattr(torch.ops.opforge, name).default)
    for args, exc, match in softmax_bad_inputs(f"opforge.{name}"):
        raises_everywhere(fns, args, exc, match)
    # Arguments of the wrong kind: torch's binding names the argument and the expected type.
    for args, argname in (([1.0, 2.0],), "x"), ((torch.randn(3), 1.5), "dim"), ((torch.randn(3), 0, "float"), "dtype"):
        for fn in fns:
            with pytest.raises(RuntimeError, match=rf"Expected a value of type .* for argument '{argname}'"):
                fn(*args)


def test_scaled_masked_bad_inputs():
    op = "opforge.scaled_masked_softmax"
    fns = (opforge.scaled_masked_softmax, torch.ops.opforge.scaled_masked_softmax)
    x = torch.randn(2, 3, 4)
    cases = [
        ((torch.ones(2, 2, dtype=torch.int32),), TypeError, rf"{op}: x must be a float32.* got torch.int32"),
        ((torch.randn(()),), RuntimeError, rf"{op}: x must have at least 1 dimension \(\.\.\., Lk\), got a 0-d tensor"),
        (
            (x, torch.zeros(3, 5, dtype=torch.bool)),
            RuntimeError,
            rf"{op}: mask with shape \[3, 5\] is not broadcastable to x with shape \[2, 3, 4\]",
        ),
        (
            (x, torch.zeros(1, 2, 3, 4, dtype=torch.bool)),
            RuntimeError,
            r"mask with shape \[1, 2, 3, 4\] is not broadcastable",
        ),
        (
            (x, torch.zeros(4, dtype=torch.float64)),
            TypeError,
            rf"{op}: mask must be a bool tensor \(True = masked out\) "
            r"or an additive float mask of x's dtype \(torch.float32\), got torch.float64",
        ),
        ((x, torch.zeros(4, dtype=torch.int64)), TypeError, r"mask must be a bool tensor .* got torch.int64"),
    ]
    for args, exc, match in cases:
        raises_everywhere(fns, args, exc, match)
    for args, argname in (((x, [True]), "mask"), ((x, None, "1"), "scale"), ((x, None, 1.0, "yes"), "causal")):
        for fn in fns:
            with pytest.raises(RuntimeError, match=rf"Expected a value of type .* for argument '{argname}'"):
                fn(*args)
    # The schema's float takes a Python int as it is.
    torch.testing.assert_close(opforge.scaled_masked_softmax(x, None, 2), opforge.scaled_masked_softmax(x, None, 2.0))


@pytest.mark.parametrize("op", ["_softmax_backward", "_log_softmax_backward", "_scaled_masked_softmax_backward"])
def test_backward_op_bad_inputs(op):
    raw = getattr(torch.ops.opforge, op)
    name = f"opforge.{op}"
    scaled = op == "_scaled_masked_softmax_backward"
    third = 0.5 if scaled else -1
    y = torch.softmax(torch.randn(3, 4), -1)
    cases = [
        (
            (torch.randn(3, 5), y, third),
            RuntimeError,
            rf"{name}: grad and output must have the same shape, got grad \[3, 5\] and output \[3, 4\]",
        ),
        (
            (torch.randn(3, 4, dtype=torch.float64), y, third),
            TypeError,
            rf"{name}: grad and output must have the same dtype, got grad torch.float64 and output torch.float32",
        ),
        (
            (torch.ones(3, 4, dtype=torch.int32), y, third),
            TypeError,
            rf"{name}: grad must be a float32.* got torch.int32",
        ),
        ((y, y.to(torch.int64), third), TypeError, rf"{name}: output must be a float32.* got torch.int64"),
    ]
    if not scaled:
        cases.append(
            ((torch.randn(3, 4), y, 4), IndexError, rf"{name}: dim must be in \[-2, 1\] for a 2-d output, got 4")
        )
    for args, exc, match in cases:
        raises_everywhere((raw, raw.default), args, exc, match)


def test_symbolic_shapes_in_errors():
    # Under torch.compile(dynamic=True) the shape function checks symbolic
    # sizes: a mask that cannot broadcast is reported as it is seen there.
    torch._dynamo.reset()
    f = torch.compile(opforge.scaled_masked_softmax, fullgraph=True, dynamic=True)
    symbolic = r"mask with shape \[s\d+, s\d+\] is not broadcastable to x with shape \[s\d+, "
    with pytest.raises(RuntimeError, match=symbolic):
        f(torch.randn(2, 3, 4), torch.zeros(3, 5, dtype=torch.bool))


@pytest.mark.cuda
def test_mask_on_another_device_raises():
    x = torch.randn(2, 3, 4, device="cuda")
    op = "opforge.scaled_masked_softmax"
    for fn in (opforge.scaled_masked_softmax, torch.ops.opforge.scaled_masked_softmax):
        with pytest.raises(
            RuntimeError, match=rf"{op}: x and mask must be on the same device, got x on cuda:0 and mask on cpu"
        ):
            fn(x, torch.zeros(4, dtype=torch.bool))
    y = torch.softmax(x, -1)
    with pytest.raises(
        RuntimeError, match=r"grad and output must be on the same device, got grad on cpu and output on cuda:0"
    ):
        torch.ops.opforge._softmax_backward(y.cpu(), y, -1)


def test_shape_functions_match_kernels():
    # Meta results have the kernels' shape, dtype and (contiguous) strides,
    # non-contiguous inputs and dtype= included.
    x = rand((4, 6, 5)).transpose(0, 2)
    mask = torch.rand((6, 1)) < 0.3
    g = rand((5, 6, 4))
    y = torch.softmax(rand((5, 6, 4)), 1).transpose(0, 2)
    calls = [
        (torch.ops.opforge.softmax, (x, 1, None)),
        (torch.ops.opforge.softmax, (x, 0, torch.float64)),
        (torch.ops.opforge.log_softmax, (x.half(), -1, torch.float32)),
        (torch.ops.opforge.scaled_masked_softmax, (x, mask, 0.5, True)),
        (torch.ops.opforge._softmax_backward, (g.transpose(0, 2), y, 1)),
        (torch.ops.opforge._log_softmax_backward, (g.transpose(0, 2), y, 0)),
        (torch.ops.opforge._scaled_masked_softmax_backward, (g.transpose(0, 2), y, 0.5)),
    ]
    for op, args in calls:
        real, meta = op(*args), op(*on_meta(args))
        assert meta.device.type == "meta" and real.is_contiguous()
        assert (meta.shape, meta.dtype, meta.stride()) == (real.shape, real.dtype, real.stride()), op


# --------------------------------------------------------------------------- backward


def ref_bwd(name, g, y, dim, scale=1.0):
    g64, y64 = g.double().cpu(), y.double().cpu()
    if name == "log_softmax":
        return ((g64 - torch.exp(y64) * g64.sum(dim, keepdim=True)) * scale).to(y.dtype)
    return (y64 * (g64 - (g64 * y64).sum(dim, keepdim=True)) * scale).to(y.dtype)


def check_bwd(name, out, g, y, dim, scale=1.0):
    """A fused backward's `out` (scale times dx) against float64, within the derived bound."""
    expected = ref_bwd(name, g, y, dim, scale)
    assert_within(out.cpu(), expected, backward_bound(name, g, y, dim, expected, scale))


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


# --------------------------------------------------------------------------- torch.library / compile


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(dtype, device):
    x = rand((4, 6, 9), dtype, device).requires_grad_()
    for dim in (-1, 1):
        torch.library.opcheck(torch.ops.opforge.softmax.default, (x, dim, None))
        torch.library.opcheck(torch.ops.opforge.log_softmax.default, (x, dim, None))
    torch.library.opcheck(torch.ops.opforge.softmax.default, (x, 0, torch.float64))
    mask = torch.rand((6, 9), device=device) < 0.3
    torch.library.opcheck(torch.ops.opforge.scaled_masked_softmax.default, (x, mask, 0.5, True))
    torch.library.opcheck(torch.ops.opforge.scaled_masked_softmax.default, (x, None, 2.0, False))
    fmask = rand((4, 1, 9), dtype, device).requires_grad_()
    torch.library.opcheck(torch.ops.opforge.scaled_masked_softmax.default, (x, fmask, 0.5, False))
    g = rand((4, 6, 9), dtype, device)
    y = torch.softmax(rand((4, 6, 9), dtype, device), 1).requires_grad_()
    torch.library.opcheck(torch.ops.opforge._softmax_backward.default, (g, y, 1))
    torch.library.opcheck(torch.ops.opforge._log_softmax_backward.default, (g, y.log().detach(), -1))
    torch.library.opcheck(torch.ops.opforge._scaled_masked_softmax_backward.default, (g, y, 0.25))


class TinyAttention(torch.nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.attn = opforge.nn.ScaledMaskedSoftmax(scale=width**-0.5, causal=True)
        self.norm = opforge.nn.Softmax(-1)
        self.logp = opforge.nn.LogSoftmax(dim=1)

    def forward(self, x, pad):
        q, k, v = self.qkv(x).chunk(3, -1)
        p = self.attn(q @ k.transpose(-2, -1), pad[:, None, :])
        return self.logp(self.norm(p @ v))


def eager_tiny(model, x, pad):
    q, k, v = model.qkv(x).chunk(3, -1)
    s = q @ k.transpose(-2, -1) * model.attn.scale
    lq = s.shape[-1]
    above = torch.ones(lq, lq, dtype=torch.bool, device=s.device).triu(1)
    p = torch.softmax(s.masked_fill(above | pad[:, None, :], -INF), -1)
    return torch.log_softmax(torch.softmax(p @ v, -1), 1)


def test_compile_fullgraph_dynamic_no_recompiles(device):
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    model = TinyAttention().to(device)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=True)
    frames = []
    for seq in (5, 9, 17, 40):
        x = rand((2, seq, 16), device=device)
        pad = torch.zeros((2, seq), dtype=torch.bool, device=device)
        pad[1, -2:] = True  # key padding
        torch.testing.assert_close(compiled(x, pad), model(x, pad))
        torch.testing.assert_close(model(x, pad), eager_tiny(model, x, pad), atol=1e-5, rtol=1e-5)
        frames.append(counter.frame_count)
    # No recompile across sequence lengths. (dynamic=True first traces the
    # float `scale` attribute as a symbolic float; the op takes a plain
    # float, so the first compile restarts once with it specialised: at most
    # two graphs, both from the first call.)
    assert frames[0] <= 2 and frames == [frames[0]] * len(frames), f"recompiled: {frames}"


def test_compile_no_restart_with_constant_scale(device):
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")

    @torch.compile(backend=counter, fullgraph=True, dynamic=True)
    def f(x, mask):
        return opforge.scaled_masked_softmax(x, mask, 0.125, True) + opforge.softmax(x, 1)

    for seq in (6, 11, 30):
        x = rand((2, 3, seq, seq), device=device)
        mask = torch.rand((seq, seq), device=device) < 0.2
        torch.testing.assert_close(
            f(x, mask), ref_smsm(x, mask, 0.125, True).to(device) + torch.softmax(x, 1), atol=1e-5, rtol=1e-5
        )
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} frames"


def test_compile_backward(device):
    torch._dynamo.reset()
    model = TinyAttention().to(device)
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    x = rand((2, 7, 16), device=device).requires_grad_()
    pad = torch.zeros((2, 7), dtype=torch.bool, device=device)
    compiled(x, pad).sum().backward()
    gx = x.grad.clone()
    x.grad = None
    model(x, pad).sum().backward()
    torch.testing.assert_close(gx, x.grad)


def test_nn_modules(device):
    x = rand((3, 4, 5), device=device)
    assert repr(opforge.nn.Softmax(1)) == "Softmax(dim=1)"
    assert repr(opforge.nn.ScaledMaskedSoftmax(0.5, True)) == "ScaledMaskedSoftmax(scale=0.5, causal=True)"
    torch.testing.assert_close(opforge.nn.Softmax(1)(x), torch.softmax(x, 1))
    torch.testing.assert_close(opforge.nn.LogSoftmax(0)(x), torch.log_softmax(x, 0))
    torch.testing.assert_close(opforge.nn.ScaledMaskedSoftmax(0.5)(x), torch.softmax(x * 0.5, -1))
    mask = torch.rand((4, 5), device=device) < 0.3
    torch.testing.assert_close(opforge.nn.ScaledMaskedSoftmax()(x, mask), opforge.scaled_masked_softmax(x, mask))


@pytest.mark.cuda
def test_cuda_graph_capture_and_replay():
    x = rand((64, 4096), device="cuda")
    long = rand((300, 40000), device="cuda")  # float32 rows longer than a block: resident clusters
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up before capture, as torch asks
        opforge.softmax(x)
        opforge.scaled_masked_softmax(x, causal=True)
        opforge.softmax(long)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = opforge.softmax(x)
        out2 = opforge.scaled_masked_softmax(x, None, 0.5, True)
        out3 = opforge.softmax(long)
    x.copy_(rand((64, 4096), device="cuda"))
    long.copy_(rand((300, 40000), device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, torch.softmax(x, -1))
    torch.testing.assert_close(out2, ref_smsm(x, None, 0.5, True).cuda())
    torch.testing.assert_close(out3, torch.softmax(long, -1))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(8, 262144), (2, 1 << 20), (1, 3_000_001)])
def test_cuda_long_rows(dtype, shape):
    for name in OPS:
        check(name, rand(shape, dtype, "cuda", scale=3.0), -1)
    y = opforge.softmax(rand(shape, dtype, "cuda"))
    g = rand(shape, dtype, "cuda")
    check_bwd("softmax", torch.ops.opforge._softmax_backward(g, y, -1), g, y, -1)


@pytest.mark.cuda
def test_cuda_misaligned_vector_fallback():
    for dtype in (torch.float32, torch.bfloat16):
        flat = rand((4 * 4096 + 1,), dtype, "cuda")
        x = flat[1:].view(4, 4096)  # contiguous, but rows start off the 16-byte grid
        assert x.is_contiguous() and x.data_ptr() % 16 != 0
        check("softmax", x, -1)
        check("log_softmax", x, -1)
        check_smsm(x.view(1, 4, 4096), None, 0.5, causal=True)
        y = opforge.softmax(x)
        g = rand((4, 4096), dtype, "cuda")
        check_bwd("softmax", torch.ops.opforge._softmax_backward(g, y, -1), g, y, -1)


# Explicit launch plans (threads per row, rows per block, vectors per thread,
# cluster): every kind of plan the default heuristic may choose, on row
# lengths that fill a block exactly, partly, or spill into a last chunk.
# float16 and bfloat16 hold their values packed: up to 16 vectors (128
# values) per thread forward, 8 backward.
PLANS = [
    (64, (32, 4, 1, False)),  # warp per row, several rows per block
    (64, (8, 16, 4, False)),  # a slice of a warp per row
    (13, (1, 128, 16, False)),  # a thread per row holding the row (scalar loads: 13 is odd)
    (4096, (256, 1, 4, False)),  # block per row
    (40000, (512, 1, 4, True)),  # cluster of several blocks (or split where clusters are unavailable)
    (70001, (512, 1, 8, True)),  # cluster past 8 blocks for scalar loads
    (40000, (256, 1, 2, False)),  # two-pass split
    (3000, (128, 1, 8, False)),  # rows shorter than the block holds
    (70000, (256, 1, 16, True)),  # clusters of threads holding 64 registers of values
    (300000, (128, 1, 16, False)),  # two-pass split of long chunks
]


def max_vectors(dtype, K, arrays):
    """The kernels' limit: 64 registers of `arrays` opmath values per element (1 forward, 2 backward),
    or of values as loaded, two per register (16-byte vectors of 2-byte types)."""
    size = torch.empty((), dtype=dtype).element_size()
    width = 16 // size
    v = width if K % width == 0 else 1  # 16-byte vectors only when rows keep the alignment
    words_per_vec = v // 2 * arrays if size == 2 and v > 1 else v * arrays * (2 if size == 8 else 1)
    it = 16
    while it > 1 and it * words_per_vec > 64:
        it //= 2
    return it


def plan_rows(dtype, K):
    """Rows for an explicit plan: several times what the GPU holds at once, one -inf entry."""
    M = 6_000_000 // K + 7
    x = rand((M, K), dtype, "cuda", scale=3.0)
    x[1, K // 3] = float("-inf")
    return M, x


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("K,plan", PLANS)
def test_cuda_explicit_plans(dtype, K, plan):
    M, x = plan_rows(dtype, K)
    tpr, rpb, vectors, cluster = plan
    with poisoned("cuda"):
        y = torch.ops.opforge_bench.softmax_plan(x, tpr, rpb, min(vectors, max_vectors(dtype, K, 1)), cluster)
    check_fwd("softmax", y, x, -1)
    g = rand((M, K), dtype, "cuda")
    vectors = min(vectors, max_vectors(dtype, K, 2))
    with poisoned("cuda"):
        gx = torch.ops.opforge_bench.softmax_backward_plan(g, y, tpr, rpb, vectors, cluster)
    check_bwd("softmax", gx, g, y, -1)


# Resident clusters (persistent forward plans): each cluster walks several
# rows (more rows than clusters fit on the GPU, not a multiple of them), so
# both slot sets and the hand-over of the next row's staged loads are
# exercised, on rows with special values in some chunks only. Built for
# float32 in 16-byte vectors; other dtypes (bfloat16 here) and odd rows run
# the same plan as a cluster per row.
RESIDENT_PLANS = [
    (40000, (512, 1, 4)),  # clusters of several blocks
    (40000, (256, 1, 8)),  # clusters of 256-thread blocks, last chunk partly filled
    (70001, (512, 1, 8)),  # scalar loads (odd K): a cluster per row instead
    (65536, (512, 1, 16)),  # 64 registers of values per thread
    (4096, (256, 1, 4)),  # a resident block per row (a cluster of one)
    (3000, (128, 1, 8)),  # rows shorter than the block holds
]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K,plan", RESIDENT_PLANS)
def test_cuda_resident_cluster_plans(dtype, K, plan):
    M, x = plan_rows(dtype, K)
    x[2] = float("-inf")  # a whole row of -inf: NaN, as torch
    x[3, : K // 2] = float("-inf")  # chunks of only -inf beside finite ones
    x[4, 7] = float("nan")
    x[M - 1, K - 1] = float("inf")
    tpr, rpb, vectors = plan
    with poisoned("cuda"):
        y = torch.ops.opforge_bench.softmax_plan(x, tpr, rpb, min(vectors, max_vectors(dtype, K, 1)), True, True)
    check_fwd("softmax", y, x, -1, equal_nan=True)
    assert y[2].isnan().all() and y[4].isnan().all() and y[M - 1].isnan().all() and not y[3].isnan().any()
    assert (y[3, : K // 2] == 0).all()


# Backward plans split over a cluster of more than 8 blocks, or asking for
# more vectors per thread than dy and y together fit, hold y only (dy is
# read again for dx): up to the forward's vectors per thread, 16 in 16-byte
# vectors. The same request on rows one block holds, or rows longer than a
# cluster of 16 holds, runs with both arrays held, at their limit.
BWD_CLUSTER_PLANS = [
    (200000, (512, 1, 16)),  # clusters of blocks holding 64 registers of y
    (65536, (256, 1, 4)),  # the fewest vectors the y-only kernel takes: float32 in 16 blocks
    (131072, (256, 1, 4)),  # likewise the 2-byte types (float64: the split)
    (3000, (512, 1, 16)),  # one block holds the row: both arrays, 8 vectors
    (1_200_000, (512, 1, 16)),  # longer than a cluster holds: the split, 8 vectors
]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("K,plan", BWD_CLUSTER_PLANS)
def test_cuda_backward_cluster_plans(dtype, K, plan):
    M = max(3, 2_000_000 // K)
    y = opforge.softmax(rand((M, K), dtype, "cuda", scale=3.0))
    g = rand((M, K), dtype, "cuda")
    tpr, rpb, vectors = plan
    with poisoned("cuda"):
        gx = torch.ops.opforge_bench.softmax_backward_plan(g, y, tpr, rpb, min(vectors, max_vectors(dtype, K, 1)), True)
    check_bwd("softmax", gx, g, y, -1)


@pytest.mark.cuda
@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,K", [(203, 40000), (7, 500000)])
def test_cuda_long_rows_default_plan(name, dtype, M, K):
    """Rows longer than one block (the default's resident clusters) over more rows than clusters;
    rows of 500000, which a cluster holds in the backward only with y alone (float32: 16 x 512 x 64)."""
    x = rand((M, K), dtype, "cuda", scale=3.0)
    x[5, : K // 2] = float("-inf")
    y = check(name, x, -1)
    g = rand((M, K), dtype, "cuda")
    backward = torch.ops.opforge._softmax_backward if name == "softmax" else torch.ops.opforge._log_softmax_backward
    check_bwd(name, backward(g, y, -1), g, y, -1)


@pytest.mark.cuda
def test_cuda_explicit_plan_errors():
    x = torch.randn(4, 1024, device="cuda")
    with pytest.raises(ValueError, match="threads_per_row must be a power of two in \\[1, 512\\], got 48"):
        torch.ops.opforge_bench.softmax_plan(x, 48, 1, 1, False)
    with pytest.raises(ValueError, match="rows_per_block must be a power of two with rows_per_block x threads_per_row"):
        torch.ops.opforge_bench.softmax_plan(x, 256, 4, 1, False)
    with pytest.raises(ValueError, match="vectors_per_thread must be a power of two <= 16 .* got 32"):
        torch.ops.opforge_bench.softmax_plan(x, 32, 1, 32, False)
    with pytest.raises(ValueError, match="a plan that splits rows or keeps clusters resident needs one row per block"):
        torch.ops.opforge_bench.softmax_plan(x, 32, 4, 1, False)
    with pytest.raises(ValueError, match="threads_per_row must be in \\[1, 512\\], got 0"):
        torch.ops.opforge_bench.softmax_plan(x, 0, 1, 1, False)
    with pytest.raises(ValueError, match="persistent clusters need cluster=True"):
        torch.ops.opforge_bench.softmax_plan(x, 256, 1, 1, False, True)
