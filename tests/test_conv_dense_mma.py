"""The CUDA tensor-core dense 3x3 conv (implicit GEMM, fused bias + ReLU),
through its test entry ``torch.ops.opforge_bench.conv_dense_mma``.

Every result is checked element by element against F.conv2d (+ relu) in
float64 of the SAME rounded inputs, with a rigorous error bound rather than a
flat tolerance:

    |out - ref| <= u_out * |ref| + (1 + u_out) * acc_bound + tiny

* ``u_out`` is the unit roundoff of the output dtype (2^-8 bfloat16, 2^-11
  float16, 2^-24 float32): the one final rounding. For bfloat16 this is the
  ~1e-2 relative tolerance of the project (0.39%), for float16 ~1e-3.
* ``acc_bound = absref * (prod_err + 9*C * 2^-23)`` with absref =
  conv(|x|, |w|) + |bias|: the fp32 accumulation of the 9*C products, even if
  every addition truncated instead of rounding. bfloat16/float16 products are
  exact in fp32 (prod_err = 0); TF32 rounds both inputs to 10 mantissa bits
  (rna), so each product is off by at most ~2^-10 relative (prod_err = 2^-10
  + 2^-20).

A missing tap, channel chunk, halo or bias shows up far above this bound for
random inputs. Outputs are poisoned (NaN) before the kernel writes them and
NaN never passes. All tests but the schema one need a GPU.
"""

import contextlib
import itertools
import random

import pytest
import torch
import torch.nn.functional as F
from reference import poisoned

import opforge  # noqa: F401  (registers the ops)

UNIT = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}
PROD_ERR = {torch.bfloat16: 0.0, torch.float16: 0.0, torch.float32: 2.0**-10 + 2.0**-20}


def mma_op():
    return torch.ops.opforge_bench.conv_dense_mma


@contextlib.contextmanager
def cudnn_tf32(allowed: bool):
    old = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = allowed
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32 = old


def make_inputs(n, c, h, w, k, dtype, bias, channels_last, device="cuda"):
    x = torch.randn(n, c, h, w, device=device, dtype=torch.float64).to(dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    wt = (torch.randn(k, c, 3, 3, device=device, dtype=torch.float64) / (3.0 * c**0.5)).to(dtype)
    b = torch.randn(k, device=device, dtype=torch.float64).to(dtype) if bias else None
    return x, wt, b


def reference(x, w, b, stride, padding, relu):
    """float64 result on the rounded inputs and the matching error bound's absref."""
    x64, w64 = x.double(), w.double()
    b64 = b.double() if b is not None else None
    ref = F.conv2d(x64, w64, b64, stride=stride, padding=padding)
    if relu:
        ref = torch.relu(ref)
    absref = F.conv2d(x64.abs(), w64.abs(), b64.abs() if b64 is not None else None, stride=stride, padding=padding)
    return ref, absref


def check(x, w, b, stride, padding, relu):
    dtype = x.dtype
    with poisoned(x.device):
        out = mma_op()(x, w, b, stride, padding, relu)
    ref, absref = reference(x, w, b, stride, padding, relu)
    assert out.dtype == dtype and out.device == x.device
    assert out.shape == ref.shape, (out.shape, ref.shape)
    # the output takes x's suggested memory format: channels_last for
    # channels_last-like strides (also a channels_last slice), else contiguous
    if x.stride(1) < x.stride(3) <= x.stride(2) <= x.stride(0):
        assert out.is_contiguous(memory_format=torch.channels_last)
    else:
        assert out.is_contiguous()
    got = out.double()
    assert not torch.isnan(got).any(), f"{int(torch.isnan(got).sum())} NaN (unwritten or wrong) elements"
    u = UNIT[dtype]
    c = x.shape[1]
    acc = absref * (PROD_ERR[dtype] + 9 * c * 2.0**-23)
    tol = u * ref.abs() + (1 + u) * acc + 1e-30
    err = (got - ref).abs()
    bad = err > tol
    if bad.any():
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise AssertionError(
            f"{int(bad.sum())}/{bad.numel()} elements out of bound; first at {idx}: got {got[idx].item()}, "
            f"expected {ref[idx].item()}, bound {tol[idx].item()}; max err/bound {float((err / tol).max()):.3g}"
        )
    if relu:
        assert (got >= 0).all()
    return out


# ---- the configuration grid -------------------------------------------------

CS = [8, 16, 64, 256]
KS = [8, 64, 128, 256]
HWS = [3, 5, 17, 56, 63]
NS = [1, 2, 8]


def sampled_cases(count, seed):
    """A fixed, spread-out sample of the full grid (the inputs stay fresh)."""
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        n, c, k = rng.choice(NS), rng.choice(CS), rng.choice(KS)
        h, w = rng.choice(HWS), rng.choice(HWS)
        stride, padding = rng.choice([1, 2]), rng.choice([0, 1])
        bias, relu, cl = rng.random() < 0.5, rng.random() < 0.5, rng.random() < 0.5
        # keep the float64 reference cheap: at most ~2 GFLOP per case
        while n > 1 and 2 * n * c * k * 9 * h * w > 2e9:
            n //= 2
        cases.append((n, c, h, w, k, stride, padding, bias, relu, cl))
    return cases


def case_id(case):
    n, c, h, w, k, stride, padding, bias, relu, cl = case
    return (
        f"N{n}C{c}H{h}W{w}K{k}-s{stride}p{padding}"
        + ("-bias" if bias else "")
        + ("-relu" if relu else "")
        + ("-cl" if cl else "-nchw")
    )


# Every flag combination on a small shape with M, K and C tails and a K_gemm
# tile that straddles taps (C = 16: 32-element tiles span two taps).
FLAG_CASES = [
    (2, 16, 5, 17, 8, s, p, b, r, cl)
    for s, p, b, r, cl in itertools.product([1, 2], [0, 1], [False, True], [False, True], [False, True])
]
# The benchmark shapes (batch reduced) and the grid's extremes.
SHAPE_CASES = [
    (2, 64, 56, 56, 64, 1, 1, True, True, True),
    (2, 64, 56, 56, 64, 1, 1, True, True, False),
    (2, 256, 28, 28, 256, 1, 1, True, True, True),
    (1, 128, 56, 56, 128, 1, 1, True, True, True),
    (1, 128, 56, 56, 128, 2, 1, True, False, False),
    (1, 8, 3, 3, 8, 1, 0, True, True, True),  # a single output pixel
    (1, 8, 3, 3, 8, 2, 1, False, False, False),
    (8, 256, 3, 3, 256, 1, 1, True, False, True),
    (1, 256, 63, 63, 8, 2, 0, True, True, False),
    (8, 8, 63, 5, 256, 1, 1, False, True, True),
]
BF16_CASES = FLAG_CASES + SHAPE_CASES + sampled_cases(60, seed=1)
FP16_CASES = SHAPE_CASES + sampled_cases(30, seed=2)
TF32_CASES = FLAG_CASES[::3] + SHAPE_CASES[:4] + sampled_cases(30, seed=3)


@pytest.mark.cuda
@pytest.mark.parametrize("case", BF16_CASES, ids=case_id)
def test_bfloat16(case):
    n, c, h, w, k, stride, padding, bias, relu, cl = case
    check(*make_inputs(n, c, h, w, k, torch.bfloat16, bias, cl), stride, padding, relu)


@pytest.mark.cuda
@pytest.mark.parametrize("case", FP16_CASES, ids=case_id)
def test_float16(case):
    n, c, h, w, k, stride, padding, bias, relu, cl = case
    check(*make_inputs(n, c, h, w, k, torch.float16, bias, cl), stride, padding, relu)


@pytest.mark.cuda
@pytest.mark.parametrize("case", TF32_CASES, ids=case_id)
def test_float32_tf32(case):
    n, c, h, w, k, stride, padding, bias, relu, cl = case
    with cudnn_tf32(True):
        check(*make_inputs(n, c, h, w, k, torch.float32, bias, cl), stride, padding, relu)


# Tails the grid does not reach: K not a multiple of 8 (scalar channels_last
# stores, N-tile predication), C not a multiple of 32 (taps straddling a
# K_gemm tile at odd offsets), M of one pixel, W = 3 with stride 2.
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "shape",
    [(3, 24, 7, 9, 3), (2, 40, 11, 4, 13), (1, 72, 9, 9, 100), (2, 8, 4, 3, 65), (1, 136, 6, 6, 129)],
    ids=lambda s: "N{}C{}H{}W{}K{}".format(*s),
)
@pytest.mark.parametrize("cl", [False, True], ids=["nchw", "cl"])
@pytest.mark.parametrize("stride,padding", [(1, 0), (1, 1), (2, 0), (2, 1)])
def test_odd_tails(dtype, shape, cl, stride, padding):
    n, c, h, w, k = shape
    with cudnn_tf32(True):
        check(*make_inputs(n, c, h, w, k, dtype, True, cl), stride, padding, relu=True)


# The kernel picks its tile by grid size (on an H200's 132 SMs): 128x128
# (half types, K > 64, >= 2 CTAs per SM), 128x64 (>= 4 CTAs per SM), else
# 64x64, which every smaller case above takes. These run the two large
# configurations on every dtype and both output layouts, with K and M tails.
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "case",
    [
        (32, 64, 56, 56, 64, 1, 1, True, True, True),
        (32, 64, 56, 56, 64, 1, 1, True, True, False),
        (16, 16, 63, 63, 100, 1, 1, True, False, True),
        (16, 16, 63, 63, 100, 1, 0, False, True, False),
        (48, 24, 65, 63, 72, 2, 1, True, True, True),
        (8, 32, 56, 56, 200, 1, 1, True, True, True),
        (8, 32, 56, 56, 200, 1, 1, True, False, False),
        (8, 128, 32, 32, 256, 1, 1, True, True, True),
    ],
    ids=case_id,
)
def test_large_grids(dtype, case):
    n, c, h, w, k, stride, padding, bias, relu, cl = case
    with cudnn_tf32(True):
        check(*make_inputs(n, c, h, w, k, dtype, bias, cl), stride, padding, relu)


# Each tile configuration forced on small problems with every tail.
@pytest.mark.cuda
@pytest.mark.parametrize("tile", ["128x128", "128x64", "64x64", "128x32"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "case",
    [
        (2, 16, 5, 17, 8, 1, 1, True, True, True),
        (3, 24, 13, 11, 130, 2, 1, True, False, False),
        (2, 40, 17, 9, 200, 1, 0, False, True, True),
        (1, 64, 30, 30, 64, 1, 1, True, True, False),
    ],
    ids=case_id,
)
def test_forced_tiles(tile, dtype, case, monkeypatch):
    monkeypatch.setenv("OPFORGE_CONV_MMA_TILE", tile)  # 128x128 falls back to the rule for float32
    n, c, h, w, k, stride, padding, bias, relu, cl = case
    with cudnn_tf32(True):
        check(*make_inputs(n, c, h, w, k, dtype, bias, cl), stride, padding, relu)


@pytest.mark.cuda
def test_float32_small_channels():
    # float32 chunks are 4 values: C = 4 and 12 are accepted.
    with cudnn_tf32(True):
        for c in (4, 12):
            check(*make_inputs(2, c, 9, 10, 16, torch.float32, True, False), 1, 1, True)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_strided_and_offset_inputs(dtype):
    # Non-contiguous x and w (one internal copy to NHWC / (K,3,3,C)) and an x
    # that is a channels_last slice of a larger tensor.
    base = torch.randn(2, 64, 20, 40, device="cuda").to(dtype)
    x = base[:, 16:48, :, ::2]
    w = (torch.randn(16, 32, 3, 3, device="cuda") / 17).to(dtype).transpose(2, 3)
    check(x, w, torch.randn(16, device="cuda").to(dtype), 1, 1, True)
    base_cl = base.contiguous(memory_format=torch.channels_last)
    check(base_cl[:, 8:40], w, None, 2, 0, False)


@pytest.mark.cuda
def test_repeated_calls_are_identical():
    x, w, b = make_inputs(2, 64, 17, 17, 64, torch.bfloat16, True, True)
    first = mma_op()(x, w, b, 1, 1, True)
    for _ in range(3):
        assert torch.equal(mma_op()(x, w, b, 1, 1, True), first)


@pytest.mark.cuda
def test_empty_batch():
    x, w, b = make_inputs(0, 16, 8, 8, 8, torch.bfloat16, True, False)
    out = mma_op()(x, w, b, 1, 1, True)
    assert out.shape == (0, 8, 8, 8)


@pytest.mark.cuda
def test_current_stream():
    x, w, b = make_inputs(4, 64, 28, 28, 64, torch.bfloat16, True, True)
    expected = mma_op()(x, w, b, 1, 1, True)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        got = mma_op()(x, w, b, 1, 1, True)
    torch.cuda.current_stream().wait_stream(s)
    assert torch.equal(got, expected)


@pytest.mark.cuda
def test_cuda_graph_capture():
    x, w, b = make_inputs(2, 32, 15, 15, 64, torch.float16, True, False)
    expected = mma_op()(x, w, b, 1, 1, False)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        mma_op()(x, w, b, 1, 1, False)  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = mma_op()(x, w, b, 1, 1, False)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)


# ---- cases the tensor-core path declines (the caller falls back) -------------


@pytest.mark.cuda
@pytest.mark.parametrize(
    "dtype,c,tf32",
    [
        (torch.bfloat16, 12, True),  # C % 8 != 0
        (torch.float16, 4, True),
        (torch.float32, 6, True),  # C % 4 != 0
        (torch.float32, 16, False),  # TF32 not allowed for cuDNN convs: F.conv2d would be exact fp32
        (torch.float64, 16, True),
    ],
)
def test_declines(dtype, c, tf32):
    x, w, b = make_inputs(1, c, 6, 6, 8, dtype, True, False)
    with cudnn_tf32(tf32), pytest.raises(RuntimeError, match="tensor-core path declines"):
        mma_op()(x, w, b, 1, 1, True)


@pytest.mark.cuda
def test_bad_arguments():
    x, w, b = make_inputs(1, 16, 6, 6, 8, torch.bfloat16, True, False)
    with pytest.raises(ValueError, match="stride must be 1 or 2, got 3"):
        mma_op()(x, w, b, 3, 1, True)
    with pytest.raises(ValueError, match="padding must be 0 or 1, got 2"):
        mma_op()(x, w, b, 1, 2, True)
    with pytest.raises(RuntimeError, match=r"w must have shape \(K, 16, 3, 3\)"):
        mma_op()(x, w[:, :8], b, 1, 1, True)
    with pytest.raises(RuntimeError, match=r"bias must have shape \(8\)"):
        mma_op()(x, w, b[:4], 1, 1, True)
    with pytest.raises(TypeError, match="w must have x's dtype"):
        mma_op()(x, w.half(), b, 1, 1, True)


@pytest.mark.parametrize("channels_last", [False, True])
def test_shape_function(channels_last):
    """The entry's Meta kernel: its checks and output (shape, x's memory format) without a GPU."""
    x, w, b = make_inputs(2, 16, 9, 7, 8, torch.bfloat16, True, channels_last, device="meta")
    out = mma_op()(x, w, b, 2, 1, True)
    assert out.shape == (2, 8, 5, 4) and out.device.type == "meta"
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    assert out.is_contiguous(memory_format=fmt)
    with pytest.raises(ValueError, match="stride must be 1 or 2, got 3"):
        mma_op()(x, w, b, 3, 1, True)
    with pytest.raises(RuntimeError, match=r"w must have shape \(K, 16, 3, 3\)"):
        mma_op()(x, w[:, :8], b, 1, 1, True)


def test_schema_registered():
    schema = str(torch.ops.opforge_bench.conv_dense_mma.default._schema)
    assert schema == (
        "opforge_bench::conv_dense_mma(Tensor x, Tensor w, Tensor? bias, int stride, int padding, bool relu) -> Tensor"
    )
