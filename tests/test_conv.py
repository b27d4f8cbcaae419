"""opforge.conv2d_3x3's values and gradients against float64, every dtype, layout and loop path.

The tolerances, and why they are what they are: conv_check.py.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from conv_check import (
    CONFIGS,
    FP32_PRODUCT_ERR,
    TF32_PRODUCT_ERR,
    TF32_TOL,
    assert_within_tf32_bound,
    check,
    reduction_atol,
    reference,
)
from cpu_isa import run_capped
from reference import DTYPES, TOLERANCES, poisoned, rand

import opforge


@pytest.mark.parametrize("stride,padding", CONFIGS)
@pytest.mark.parametrize("kind", ["dense", "depthwise", "depthwise_x2"])
@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("channels_last", [False, True])
def test_values(stride, padding, kind, relu, dtype, channels_last, device):
    c = 6
    groups = 1 if kind == "dense" else c
    k = {"dense": 5, "depthwise": c, "depthwise_x2": 2 * c}[kind]
    x = rand((2, c, 9, 11), dtype, device)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    w = rand((k, c // groups, 3, 3), dtype, device)
    b = rand((k,), dtype, device)
    check(x, w, b, stride, padding, groups, relu)
    check(x, w, None, stride, padding, groups, relu)


@pytest.mark.parametrize("hw", [(3, 3), (4, 5), (5, 4), (63, 5), (3, 127), (127, 4)])
@pytest.mark.parametrize("kind", ["dense", "depthwise"])
@pytest.mark.parametrize("stride,padding", CONFIGS)
@pytest.mark.parametrize("channels_last", [False, True])
def test_odd_sizes_batch1(hw, kind, stride, padding, channels_last, device):
    c = 3
    groups = 1 if kind == "dense" else c
    x = rand((1, c, *hw), torch.float32, device)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    w = rand((4 if kind == "dense" else c, c // groups, 3, 3), torch.float32, device)
    check(x, w, rand((w.shape[0],), torch.float32, device), stride, padding, groups, True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(2, 64, 20, 24), (1, 32, 17, 33), (3, 8, 16, 64)])
@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("channels_last", [False, True])
def test_depthwise_larger(dtype, shape, stride, channels_last, device):
    # Sizes that exercise the vector loops, their tails and (on CUDA) several tiles.
    x = rand(shape, dtype, device)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    c = shape[1]
    check(x, rand((c, 1, 3, 3), dtype, device), rand((c,), dtype, device), stride, 1, c, True)


# Depthwise loop paths: channel counts that are not a multiple of the vector
# width (NHWC masked tails: 24, 40, 17, 3), rows narrower than one pixel tile
# or vector (W 3..9), output heights that leave 1, 2 or 3 rows after the
# 4-row passes (NCHW), rows wider than several vectors with a tail (70), and
# single planes that are split into row ranges across threads (C=1).
@pytest.mark.parametrize("shape", [(1, 24, 13, 21), (2, 40, 7, 3), (1, 1, 37, 70), (1, 17, 6, 9), (2, 3, 34, 19)])
@pytest.mark.parametrize("stride,padding", CONFIGS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("channels_last", [False, True])
def test_depthwise_loop_paths(shape, stride, padding, dtype, channels_last, device):
    x = rand(shape, dtype, device)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    c = shape[1]
    check(x, rand((c, 1, 3, 3), dtype, device), rand((c,), dtype, device), stride, padding, c, True)


@pytest.mark.parametrize("stride,padding", CONFIGS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("channels_last", [False, True])
def test_depthwise_multiplier3_channel_tail(stride, padding, dtype, channels_last, device):
    # Channel multiplier 3: K = 21 output channels (a vector plus a masked tail
    # on the CPU) read from 7 input channels, rows wide enough for whole tiles.
    x = rand((2, 7, 9, 37), dtype, device)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    check(x, rand((21, 1, 3, 3), dtype, device), rand((21,), dtype, device), stride, padding, 7, True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("weight_channels_last", [False, True])
def test_dense_larger(dtype, channels_last, weight_channels_last, device):
    """Above oneDNN's size on the CPU; a channels_last weight (as a channels_last model has) is
    handed to oneDNN as it is, not copied to a plain one."""
    x = rand((2, 32, 14, 15), dtype, device)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    w = rand((24, 32, 3, 3), dtype, device)
    if weight_channels_last:
        w = w.to(memory_format=torch.channels_last)
    check(x, w, rand((24,), dtype, device), 1, 1, 1, True)
    check(x, w, None, 2, 1, 1, False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("channels_last", [False, True])
def test_dense_channels_last_weight_backward(dtype, channels_last, device):
    x = rand((2, 32, 14, 15), dtype, device)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    w = rand((24, 32, 3, 3), dtype, device).to(memory_format=torch.channels_last)
    b = rand((24,), dtype, device)
    x1, w1, b1 = (t.detach().clone().requires_grad_() for t in (x, w, b))
    out = opforge.conv2d_3x3(x1, w1, b1, 1, 1, 1, "relu")
    g = rand(out.shape, dtype, device)
    with poisoned(device):
        out.backward(g)
    passed = g.double().cpu() * (out.detach().cpu() > 0).double()
    plane = out.shape[0] * out.shape[2] * out.shape[3]
    rtol = TOLERANCES[dtype][1]
    torch.testing.assert_close(
        b1.grad.double().cpu(), passed.sum((0, 2, 3)), atol=reduction_atol(dtype, plane), rtol=rtol
    )
    assert_dense_grads_close(x1.grad, w1.grad, x, w, passed)
    # Grad weight in the weight's format, as F.conv2d's: accumulated without a copy.
    assert w1.grad.stride() == w1.stride()


@pytest.mark.parametrize("shape", [(2, 16, 40, 40, 3), (1, 16, 41, 37, 2), (3, 2, 5, 200, 5), (1, 1, 3, 3, 1)])
@pytest.mark.parametrize("stride,padding", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
@pytest.mark.parametrize("channels_last", [False, True])
def test_dense_columns_paths(shape, stride, padding, dtype, channels_last, device):
    """The CPU's im2col + GEMM paths (float64 and float16 never go to
    oneDNN): an image's columns over the padded image (stride 1, NCHW) or
    in tiles of output pixels (several per image for the 40x40 shapes),
    with odd sizes and tails."""
    n, c, h, wd, k = shape
    x = rand((n, c, h, wd), dtype, device)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    check(x, rand((k, c, 3, 3), dtype, device), rand((k,), dtype, device), stride, padding, 1, True)
    check(x, rand((k, c, 3, 3), dtype, device), None, stride, padding, 1, False)


@pytest.mark.cuda
@pytest.mark.parametrize("allow_tf32", [False, True])
def test_cuda_float32_follows_allow_tf32(allow_tf32):
    old = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = allow_tf32
    try:
        x = rand((2, 64, 16, 16), torch.float32, "cuda")
        w = rand((32, 64, 3, 3), torch.float32, "cuda")
        out = opforge.conv2d_3x3(x, w, None, 1, 1, 1, "relu")
        if allow_tf32:
            assert_within_tf32_bound(out, x, w, None, 1, 1, 1, True)
        else:
            # TF32 off: the float32 bound must hold, and the TF32 error must be
            # gone: relative to sum |x||w| a TF32 result's largest error here is
            # ~8e-5 (operands rounded to 10 bits), a float32 one's ~1e-7.
            assert_within_tf32_bound(out, x, w, None, 1, 1, 1, True, product_err=FP32_PRODUCT_ERR)
            ref = reference(x, w, None, 1, 1, 1, True)
            absref = F.conv2d(x.double().cpu().abs(), w.double().cpu().abs(), None, 1, 1)
            assert ((out.cpu().double() - ref).abs() / absref.clamp_min(1e-30)).max() < 2.0**-16
    finally:
        torch.backends.cudnn.allow_tf32 = old


def test_noncontiguous_input(device):
    base = rand((2, 6, 12, 14), torch.float32, device)
    x = base[:, :, 1:10, ::2]  # neither contiguous nor channels_last
    w = rand((6, 1, 3, 3), torch.float32, device)
    check(x, w, None, 1, 1, 6, False)
    check(x, rand((4, 6, 3, 3), torch.float32, device), None, 2, 1, 1, True)


@pytest.mark.parametrize("kind", ["dense", "depthwise"])
def test_empty_batch(kind, device):
    groups = 1 if kind == "dense" else 4
    x = rand((0, 4, 8, 8), torch.float32, device)
    w = rand((4, 4 // groups, 3, 3), torch.float32, device).requires_grad_()
    out = opforge.conv2d_3x3(x, w, None, 1, 1, groups, "relu")
    assert out.shape == (0, 4, 8, 8)
    out.sum().backward()
    assert torch.equal(w.grad, torch.zeros_like(w))


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("activation", [None, "relu"])
@pytest.mark.parametrize("padding", [0, 1])
def test_zero_input_channels(with_bias, activation, padding, device):
    """x without channels: F.conv2d's result (an empty (N, 0, Ho, Wo) tensor, its
    empty-input rule) and its gradients (zeros; the bias's too), not a backend's error."""
    x = torch.empty((1, 0, 8, 8), device=device, requires_grad=True)
    w = torch.empty((4, 0, 3, 3), device=device, requires_grad=True)
    b = rand((4,), torch.float32, device).requires_grad_() if with_bias else None
    out = opforge.conv2d_3x3(x, w, b, 1, padding, 1, activation)
    ref = F.conv2d(x, w, b, 1, padding)
    if activation == "relu":
        ref = torch.relu(ref)
    assert out.shape == ref.shape == (1, 0, 8 - 2 + 2 * padding, 8 - 2 + 2 * padding)
    assert out.dtype == ref.dtype and out.device == ref.device
    inputs = (x, w) + ((b,) if with_bias else ())
    grads = torch.autograd.grad(out.sum(), inputs)
    ref_grads = torch.autograd.grad(ref.sum(), inputs)
    for got, want in zip(grads, ref_grads):
        assert got.shape == want.shape and torch.equal(got, want)
    if with_bias:
        assert grads[2].shape == (4,) and not grads[2].any()


def test_groups_zero_with_zero_channels_is_refused(device):
    x = torch.empty((1, 0, 8, 8), device=device)
    w = torch.empty((4, 0, 3, 3), device=device)
    for call in (opforge.conv2d_3x3, torch.ops.opforge.conv2d_3x3):
        with pytest.raises(ValueError, match=r"groups must be 1 or the number of input channels \(0\), got 0"):
            call(x, w, None, 1, 0, 0, "relu")


def test_nan_propagates(device):
    x = rand((1, 2, 5, 5), torch.float32, device)
    x[0, 0, 2, 2] = float("nan")
    w = rand((2, 1, 3, 3), torch.float32, device)
    out = opforge.conv2d_3x3(x, w, None, 1, 1, 2, "relu")
    assert out[0, 0, 1:4, 1:4].isnan().all() and not out[0, 1].isnan().any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("channels_last", [False, True])
def test_dense_relu_keeps_nan(dtype, channels_last, device):
    """The fused ReLU keeps NaN as torch.relu does (a library's fused ReLU
    that maps NaN to 0 would hide a diverging model)."""
    x = rand((2, 4, 6, 7), dtype, device)
    x[0, 1, 3, 3] = float("nan")
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    w, b = rand((5, 4, 3, 3), dtype, device), rand((5,), dtype, device)
    out = opforge.conv2d_3x3(x, w, b, 1, 1, 1, "relu")
    expect = torch.zeros(out.shape, dtype=torch.bool)
    expect[0, :, 2:5, 2:5] = True
    assert torch.equal(out.isnan().cpu(), expect)


@pytest.mark.parametrize("kind", ["dense", "depthwise"])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_nan_output_passes_gradient(kind, channels_last, dtype, device):
    """Where the fused ReLU's output is NaN, its backward passes the gradient,
    as torch's ReLU backward does (it zeroes only where the output is <= 0)."""
    c = 8
    groups = c if kind == "depthwise" else 1
    x = rand((2, c, 9, 10), dtype, device)
    x[0, 0, 4, 4] = float("nan")
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    w, b = rand((c, c // groups, 3, 3), dtype, device), rand((c,), dtype, device)
    out = opforge.conv2d_3x3(x, w, b, 1, 1, groups, "relu")
    assert out.isnan().any()
    g = rand(out.shape, dtype, device)
    gx, _, gb = torch.ops.opforge._conv2d_3x3_backward(g, out, x, w, 1, 1, groups, [True, True, True])
    passed = g.double().cpu() * ~(out.cpu() <= 0)
    wd = w.double().cpu().requires_grad_()
    xd = torch.zeros(x.shape, dtype=torch.float64).requires_grad_()
    F.conv2d(xd, wd, None, 1, 1, 1, groups).backward(passed)
    atol, rtol = TOLERANCES[dtype]
    if dtype == torch.float32 and device == "cuda" and groups == 1 and torch.backends.cudnn.allow_tf32:
        atol, rtol = TF32_TOL
    torch.testing.assert_close(gx.cpu().double(), xd.grad, atol=atol * math.sqrt(9 * c // groups), rtol=rtol)
    plane = out.shape[0] * out.shape[2] * out.shape[3]
    torch.testing.assert_close(gb.cpu().double(), passed.sum((0, 2, 3)), atol=reduction_atol(dtype, plane), rtol=rtol)


# --------------------------------------------------------------------------- autograd


@pytest.mark.parametrize("stride,padding", CONFIGS)
@pytest.mark.parametrize("kind", ["dense", "depthwise", "depthwise_x2"])
@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("channels_last", [False, True])
def test_gradcheck(stride, padding, kind, relu, channels_last, device):
    c = 3
    groups = 1 if kind == "dense" else c
    k = {"dense": 2, "depthwise": c, "depthwise_x2": 2 * c}[kind]
    x = rand((2, c, 6, 7), torch.float64, device)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    x.requires_grad_()
    w = rand((k, c // groups, 3, 3), torch.float64, device).requires_grad_()
    b = rand((k,), torch.float64, device).requires_grad_()
    fn = lambda x, w, b: opforge.conv2d_3x3(x, w, b, stride, padding, groups, "relu" if relu else None)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, w, b))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["dense", "depthwise", "depthwise_x2"])
@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("channels_last", [False, True])
def test_backward_matches_torch(dtype, kind, stride, channels_last, device):
    c = 8
    groups = 1 if kind == "dense" else c
    k = {"dense": 6, "depthwise": c, "depthwise_x2": 2 * c}[kind]
    x = rand((2, c, 11, 10), dtype, device)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    w, b = rand((k, c // groups, 3, 3), dtype, device), rand((k,), dtype, device)
    x1, w1, b1 = (t.detach().clone().requires_grad_() for t in (x, w, b))
    out = opforge.conv2d_3x3(x1, w1, b1, stride, 1, groups, "relu")
    g = rand(out.shape, dtype, device)
    with poisoned(device):
        out.backward(g)
    x2, w2, b2 = (t.detach().double().cpu().requires_grad_() for t in (x, w, b))
    # The ReLU mask taken from our (rounded) output: a float64 output can
    # differ in sign from a rounded one right at 0.
    F.conv2d(x2, w2, b2, stride, 1, 1, groups).backward(g.double().cpu() * (out.detach().cpu() > 0).double())
    atol, rtol = TOLERANCES[dtype]
    if dtype == torch.float32 and device == "cuda" and groups == 1 and torch.backends.cudnn.allow_tf32:
        atol, rtol = TF32_TOL
    for ours, theirs, terms in (
        (x1.grad, x2.grad, 9 * k // groups),
        (w1.grad, w2.grad, 2 * 11 * 10),
        (b1.grad, b2.grad, 2 * 11 * 10),
    ):
        assert ours.dtype == dtype and ours.shape == theirs.shape
        torch.testing.assert_close(ours.cpu().double(), theirs, atol=atol * math.sqrt(terms), rtol=rtol)


# NCHW depthwise layers of small output planes over many planes (N * C = 1536): on the
# CPU the forward (7x7 and 14x14 outputs) and the backward (7x7 outputs; at stride 2
# float32 only) run on oneDNN, the other dtypes and layouts on this library's loops.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("hw,stride", [(7, 1), (14, 1), (14, 2)])
@pytest.mark.parametrize("padding", [0, 1])
@pytest.mark.parametrize("activation", [None, "relu", "hardswish"])
def test_depthwise_many_small_planes(dtype, hw, stride, padding, activation, device):
    n, c = 4, 384
    x = rand((n, c, hw, hw), dtype, device)
    w, b = rand((c, 1, 3, 3), dtype, device), rand((c,), dtype, device)
    x1, w1, b1 = (t.detach().clone().requires_grad_() for t in (x, w, b))
    with poisoned(device):
        out = opforge.conv2d_3x3(x1, w1, b1, stride, padding, c, activation)
    assert out.is_contiguous()
    x2, w2, b2 = (t.detach().double().cpu().requires_grad_() for t in (x, w, b))
    z = F.conv2d(x2, w2, b2, stride, padding, 1, c)
    ref = {None: z, "relu": torch.relu(z), "hardswish": F.hardswish(z)}[activation]
    atol, rtol = TOLERANCES[dtype]
    # Each output: 9 products and the bias, rounded once (twice for the half types' activations).
    torch.testing.assert_close(out.detach().cpu().double(), ref.detach(), atol=atol * 2 * math.sqrt(10), rtol=2 * rtol)
    g = rand(out.shape, dtype, device)
    with poisoned(device):
        out.backward(g)
    # The activation's derivative at our own (rounded) pre-activation: a float64 one can sit on
    # the other side of relu's 0 or hardswish's +-3.
    ours_z = opforge.conv2d_3x3(x, w, b, stride, padding, c).detach().cpu().double().requires_grad_()
    act = {None: lambda t: t, "relu": torch.relu, "hardswish": F.hardswish}[activation]
    act(ours_z).backward(g.double().cpu())
    z.backward(ours_z.grad)
    terms = n * out.shape[2] * out.shape[3]
    for ours, theirs, k in ((x1.grad, x2.grad, 9), (w1.grad, w2.grad, terms), (b1.grad, b2.grad, terms)):
        assert ours.dtype == dtype and ours.shape == theirs.shape
        torch.testing.assert_close(ours.cpu().double(), theirs, atol=atol * math.sqrt(k) * 2, rtol=2 * rtol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("padding", [0, 1])
@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("c", [12, 6])
def test_depthwise_backward_stride1(dtype, padding, relu, channels_last, c, device):
    """Stride-1 depthwise backward on planes spanning several tiles, both
    paddings, with and without the fused ReLU. On CUDA grad x is the forward
    kernel run on the masked grad_out with the flipped kernel (padding
    2 - padding); NHWC with C = 6 (not a multiple of 4) takes the direct
    row kernel instead."""
    x = rand((3, c, 37, 70), dtype, device)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    w, b = rand((c, 1, 3, 3), dtype, device), rand((c,), dtype, device)
    x1, w1, b1 = (t.detach().clone().requires_grad_() for t in (x, w, b))
    out = opforge.conv2d_3x3(x1, w1, b1, 1, padding, c, "relu" if relu else None)
    g = rand(out.shape, dtype, device)
    with poisoned(device):
        out.backward(g)
    x2, w2, b2 = (t.detach().double().cpu().requires_grad_() for t in (x, w, b))
    g2 = g.double().cpu()
    if relu:
        g2 = g2 * (out.detach().cpu() > 0).double()
    F.conv2d(x2, w2, b2, 1, padding, 1, c).backward(g2)
    atol, rtol = TOLERANCES[dtype]
    plane = out.shape[0] * out.shape[2] * out.shape[3]
    torch.testing.assert_close(x1.grad.cpu().double(), x2.grad, atol=atol * 3, rtol=rtol)  # 9 terms
    for ours, theirs in ((w1.grad, w2.grad), (b1.grad, b2.grad)):
        torch.testing.assert_close(ours.cpu().double(), theirs, atol=reduction_atol(dtype, plane), rtol=rtol)
    assert all(t.grad.dtype == dtype for t in (x1, w1, b1))
    assert x1.grad.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)


STRIDE2_SHAPES = [(3, 12, 37, 70), (2, 6, 8, 7), (1, 5, 3, 3), (2, 3, 4, 33), (1, 20, 9, 6)]
# Planes of one or two rows or columns, which only padding 1 allows.
STRIDE2_TINY = [(1, 17, 1, 2), (1, 17, 2, 1), (2, 17, 2, 2), (1, 17, 1, 1)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize(
    "shape,padding", [(s, p) for s in STRIDE2_SHAPES for p in (0, 1)] + [(s, 1) for s in STRIDE2_TINY]
)
def test_depthwise_backward_stride2_cpu(dtype, padding, relu, channels_last, shape):
    """The CPU's direct stride-2 depthwise backward (NCHW: grad x from even
    and odd columns, weight sums on rows split the same way; NHWC: grad x
    walking each grad_out row column by column, the weight window moving two
    columns): odd and even sizes, channel counts with and without a vector
    tail, both paddings, against float64."""
    c = shape[1]
    x = rand(shape, dtype)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    w, b = rand((c, 1, 3, 3), dtype), rand((c,), dtype)
    out = opforge.conv2d_3x3(x, w, b, 2, padding, c, "relu" if relu else None)
    g = rand(out.shape, dtype)
    with poisoned():
        gx, gw, gb = torch.ops.opforge._conv2d_3x3_backward(g, out if relu else None, x, w, 2, padding, c, [True] * 3)
    x2, w2, b2 = (t.detach().double().requires_grad_() for t in (x, w, b))
    g2 = g.double() * (out > 0).double() if relu else g.double()
    F.conv2d(x2, w2, b2, 2, padding, 1, c).backward(g2)
    atol, rtol = TOLERANCES[dtype]
    plane = out.shape[0] * out.shape[2] * out.shape[3]
    torch.testing.assert_close(gx.double(), x2.grad, atol=atol * 2, rtol=rtol)  # at most 4 terms
    for ours, theirs in ((gw, w2.grad), (gb, b2.grad)):
        torch.testing.assert_close(ours.double(), theirs, atol=reduction_atol(dtype, plane), rtol=rtol)
    assert gx.dtype == dtype
    assert gx.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)


@pytest.mark.parametrize(
    "channels_last,stride,dtype",
    [
        (False, 1, torch.float32),
        (True, 1, torch.float32),
        (False, 2, torch.float32),
        (True, 2, torch.float32),
        (True, 2, torch.bfloat16),
    ],
)
def test_depthwise_backward_cpu_independent_of_threads(channels_last, stride, dtype):
    """The CPU weight and bias sums are added in an order fixed by the shape,
    so one thread and several give the same bits."""
    x = rand((3, 20, 29, 33), dtype)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    w, b = rand((20, 1, 3, 3), dtype), rand((20,), dtype)
    out = opforge.conv2d_3x3(x, w, b, stride, 1, 20, "relu")
    g = rand(out.shape, dtype)
    op = torch.ops.opforge._conv2d_3x3_backward
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = op(g, out, x, w, stride, 1, 20, [True, True, True])
        torch.set_num_threads(max(2, threads))
        many = op(g, out, x, w, stride, 1, 20, [True, True, True])
    finally:
        torch.set_num_threads(threads)
    for a, b_ in zip(one, many):
        assert torch.equal(a, b_)


@pytest.mark.parametrize("capability", ["default", "avx2", "avx512"])
def test_depthwise_backward_every_cpu_isa(capability):
    """The CPU depthwise backward's loops are separate machine code per ISA
    (AVX-512 walks two rows at once and splits stride-2 rows with its own
    permutes): each against float64, picked the way
    torch picks its own (ATEN_CPU_CAPABILITY caps the choice)."""
    code = """
import math, torch, torch.nn.functional as F, opforge
for dtype, atol in ((torch.float32, 1e-5), (torch.bfloat16, 1.6e-2)):
    for cl, s in ((False, 1), (True, 1), (False, 2), (True, 2)):
        for pad in (0, 1):
            for c in (20, 6):
                x = torch.randn(2, c, 13, 17, dtype=torch.float64).to(dtype)
                if cl:
                    x = x.to(memory_format=torch.channels_last)
                w = torch.randn(c, 1, 3, 3, dtype=torch.float64).to(dtype)
                b = torch.randn(c, dtype=torch.float64).to(dtype)
                y = opforge.conv2d_3x3(x, w, b, s, pad, c, "relu")
                g = torch.randn(y.shape, dtype=torch.float64).to(dtype)
                ours = torch.ops.opforge._conv2d_3x3_backward(g, y, x, w, s, pad, c, [True, True, True])
                xd, wd, bd = (t.double().requires_grad_() for t in (x, w, b))
                F.conv2d(xd, wd, bd, s, pad, 1, c).backward(g.double() * (y.double() > 0))
                terms = y.shape[0] * y.shape[2] * y.shape[3]
                for o, r, n in ((ours[0], xd.grad, 9), (ours[1], wd.grad, terms), (ours[2], bd.grad, terms)):
                    err = (o.double() - r).abs().max().item()
                    # the dtype's tolerance grown like a sum of n terms, plus (bfloat16)
                    # the rounding of the result itself
                    tol = atol * math.sqrt(n) * 2 + 2.0**-8 * r.abs().max().item() * (dtype == torch.bfloat16)
                    assert err <= tol, (dtype, cl, s, pad, c, err, tol)
print("ok")
"""
    run_capped(capability, code)


def test_double_backward_raises(device):
    x = rand((1, 2, 5, 5), torch.float64, device).requires_grad_()
    w = rand((2, 2, 3, 3), torch.float64, device).requires_grad_()
    out = opforge.conv2d_3x3(x, w, None, 1, 1, 1, "relu")
    (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    with pytest.raises(NotImplementedError, match=r"double backward .* is not supported"):
        gx.sum().backward()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("shape", [(3, 16, 28, 28, 64), (2, 8, 33, 35, 24), (1, 4, 5, 7, 3)])
def test_dense_backward_bias_and_mask(dtype, relu, channels_last, shape, device):
    """The dense backward's masked gradient and bias sums (one CUDA pass
    before cuDNN): channel counts and planes with and without 16-byte
    vectors, several blocks and plane splits, with and without the ReLU
    mask, against float64; grad bias is the same bits run to run."""
    n, c, h, wd, k = shape
    x = rand((n, c, h, wd), dtype, device)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    w, b = rand((k, c, 3, 3), dtype, device) * (9 * c) ** -0.5, rand((k,), dtype, device)
    out = opforge.conv2d_3x3(x, w, b, 1, 1, 1, "relu" if relu else None)
    g = rand(out.shape, dtype, device)
    with poisoned(device):
        gx, gw, gb = torch.ops.opforge._conv2d_3x3_backward(g, out if relu else None, x, w, 1, 1, 1, [True] * 3)
        gb_again = torch.ops.opforge._conv2d_3x3_backward(
            g, out if relu else None, x, w, 1, 1, 1, [False, False, True]
        )[2]
    assert torch.equal(gb, gb_again)
    passed = g.double().cpu() * ((out.cpu() > 0).double() if relu else 1.0)
    _, rtol = TOLERANCES[dtype]
    plane = n * h * wd
    torch.testing.assert_close(gb.cpu().double(), passed.sum((0, 2, 3)), atol=reduction_atol(dtype, plane), rtol=rtol)
    assert_dense_grads_close(gx, gw, x, w, passed)
    assert gx.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)


def assert_dense_grads_close(gx, gw, x, w, passed):
    """A dense stride-1 padding-1 conv's grad x and grad weight (cuDNN's or ATen's, given the
    masked gradient ``passed``, float64 on the CPU) against float64: sums of 9 * K and
    N * H * W terms."""
    x2, w2 = (t.detach().double().cpu().requires_grad_() for t in (x, w))
    F.conv2d(x2, w2, None, 1, 1).backward(passed)
    k, plane = w.shape[0], passed.shape[0] * passed.shape[2] * passed.shape[3]
    if x.dtype == torch.float32 and x.device.type == "cuda" and torch.backends.cudnn.allow_tf32:
        # TF32: the worst-case bound over |terms| (a sqrt(terms)-scaled
        # tolerance is only a few standard deviations of TF32's rounding
        # on thousands of terms, and a correct result would fail it)
        xa, wa = (t.detach().double().cpu().abs().requires_grad_() for t in (x, w))
        F.conv2d(xa, wa, None, 1, 1).backward(passed.abs())
        for ours, ref, absref, terms in ((gx, x2.grad, xa.grad, 9 * k), (gw, w2.grad, wa.grad, plane)):
            bound = absref * (TF32_PRODUCT_ERR + terms * 2.0**-23) + ref.abs() * 2.0**-24 + 1e-30
            err = (ours.cpu().double() - ref).abs()
            assert (err <= bound).all(), f"max err/bound {(err / bound).max().item():.3f}"
    else:
        rtol = TOLERANCES[x.dtype][1]
        torch.testing.assert_close(gx.cpu().double(), x2.grad, atol=reduction_atol(x.dtype, 9 * k), rtol=rtol)
        torch.testing.assert_close(gw.cpu().double(), w2.grad, atol=reduction_atol(x.dtype, plane), rtol=rtol)


@pytest.mark.parametrize("grads", [(True, False, True), (False, True, True), (False, False, True), (True, True, False)])
def test_dense_backward_partial_grads(grads, device):
    x = rand((2, 6, 9, 8), torch.float64, device)
    w, b = rand((10, 6, 3, 3), torch.float64, device), rand((10,), torch.float64, device)
    out = opforge.conv2d_3x3(x, w, b, 1, 1, 1, "relu")
    g = rand(out.shape, torch.float64, device)
    got = torch.ops.opforge._conv2d_3x3_backward(g, out, x, w, 1, 1, 1, list(grads))
    x2, w2, b2 = (t.detach().cpu().requires_grad_() for t in (x, w, b))
    torch.relu(F.conv2d(x2, w2, b2, 1, 1)).backward(g.cpu())
    for asked, ours, theirs in zip(grads, got, (x2.grad, w2.grad, b2.grad)):
        if asked:
            torch.testing.assert_close(ours.cpu(), theirs)
        else:
            assert ours.numel() == 0


def test_partial_grads(device):
    x = rand((1, 4, 6, 6), torch.float64, device)
    w = rand((4, 1, 3, 3), torch.float64, device).requires_grad_()
    b = rand((4,), torch.float64, device)
    opforge.conv2d_3x3(x, w, b, 1, 1, 4, "relu").sum().backward()
    assert w.grad is not None and x.grad is None
