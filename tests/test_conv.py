"""opforge.conv2d_3x3 (3x3 conv + bias + ReLU), its backward op and Conv2d3x3.

Tolerances: each output is a sum of 9*C/groups products plus the bias. With
results accumulated in opmath (float32 for the half types, TF32 for float32
dense on CUDA when allowed) and rounded once, the error is the output's
rounding (reference.TOLERANCES) plus an accumulation error that grows like
sqrt(9*C/groups) unit roundoffs of the typical term size (inputs are N(0, 1),
so terms are O(1) and the sum O(sqrt(9C))). The absolute tolerance is
therefore the dtype's atol scaled by sqrt(9*C/groups) (`_scale`), never a
fixed loose number; the reference is float64 F.conv2d on the CPU.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from cpu_isa import run_capped
from reference import DTYPES, TOLERANCES, poisoned, rand

import opforge

# float32 on CUDA may use TF32 (dense path, like F.conv2d): both operands are
# rounded to a 10-bit mantissa, so each product is off by up to ~2^-10
# relative, and the fp32 sum of 9*C of them adds up to 9*C * 2^-23 more. The
# bound below is that worst case over |x| * |w| (not a flat tolerance).
TF32_PRODUCT_ERR = 2.0**-10 + 2.0**-20
# Without TF32 each float32 product is rounded once (2^-24 relative) and the
# same worst-case sum bound applies: a cuDNN float32 algorithm's error on a
# 576-term output is not bounded by a per-element tolerance sized for a few
# terms of magnitude 1.
FP32_PRODUCT_ERR = 2.0**-24
# Gradients through cuDNN's TF32 backward (few terms per output here): a
# per-dtype style tolerance, scaled by sqrt(terms) where it is used.
TF32_TOL = (1e-3, 1e-3)


def assert_within_tf32_bound(out, x, w, b, stride, padding, groups, relu, product_err=TF32_PRODUCT_ERR):
    ref = reference(x, w, b, stride, padding, groups, relu)
    absb = None if b is None else b.double().cpu().abs()
    absref = F.conv2d(x.double().cpu().abs(), w.double().cpu().abs(), absb, stride, padding, 1, groups)
    bound = absref * (product_err + 9 * w.shape[1] * 2.0**-23) + ref.abs() * 2.0**-24 + 1e-30
    err = (out.cpu().double() - ref).abs()
    assert not torch.isnan(out).any()
    assert (err <= bound).all(), f"max err/bound {(err / bound).max().item():.3f}"


def reference(x, w, b, stride, padding, groups, relu):
    y = F.conv2d(
        x.double().cpu(), w.double().cpu(), None if b is None else b.double().cpu(), stride, padding, 1, groups
    )
    return torch.relu(y) if relu else y


def _scale(c_per_group):
    return math.sqrt(9 * c_per_group)


def _reduction_atol(dtype, terms):
    """Absolute tolerance of a sum of `terms` O(1) products (weight and bias
    gradients): the dtype's tolerance scaled like the other sums, plus the
    rounding of the accumulation itself. Summed one after another in opmath
    (unit roundoff u: float32 for every type but float64), the partial sums
    grow like sqrt(k) and their roundings add up to about terms * u / sqrt(2)
    (torch's own float32 CPU backward is off by 3-4e-4 at 7140 terms);
    four times that."""
    u = 2.0**-53 if dtype == torch.float64 else 2.0**-24
    return TOLERANCES[dtype][0] * math.sqrt(terms) + 4 * terms * u


def check(x, w, b, stride, padding, groups, relu):
    with poisoned(x.device):
        out = opforge.conv2d_3x3(x, w, b, stride, padding, groups, "relu" if relu else None)
    ref = reference(x, w, b, stride, padding, groups, relu)
    assert out.dtype == x.dtype and out.device == x.device
    assert out.shape == ref.shape, (out.shape, ref.shape)
    fmt = (
        torch.channels_last
        if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
        else torch.contiguous_format
    )
    assert out.is_contiguous(memory_format=fmt), (out.stride(), fmt)
    if x.dtype == torch.float32 and x.device.type == "cuda" and groups == 1 and torch.backends.cudnn.allow_tf32:
        assert_within_tf32_bound(out, x, w, b, stride, padding, groups, relu)
        return out
    atol, rtol = TOLERANCES[x.dtype]
    scale = _scale(w.shape[1])
    # Per element, the accumulation error also scales with that output's own
    # sum |x||w| (inputs that happen to be large there): sqrt(terms) roundings
    # of the accumulating type, four standard deviations. torch's F.conv2d
    # needs the same term on such outputs.
    absb = None if b is None else b.double().cpu().abs()
    absref = F.conv2d(x.double().cpu().abs(), w.double().cpu().abs(), absb, stride, padding, 1, groups)
    u = 2.0**-53 if x.dtype == torch.float64 else 2.0**-24
    accumulation = 4 * math.sqrt(9 * w.shape[1] + 1) * u * absref
    err = (out.cpu().double() - ref).abs()
    bound = atol * scale + rtol * ref.abs() + accumulation
    assert not torch.isnan(out).any(), "NaN in the output"
    assert (err <= bound).all(), f"max err {err.max().item():.3g}, max err/bound {(err / bound).max().item():.3f}"
    return out


CONFIGS = [(s, p) for s in (1, 2) for p in (0, 1)]


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
def test_dense_larger(dtype, channels_last, device):
    x = rand((2, 32, 14, 15), dtype, device)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    check(x, rand((24, 32, 3, 3), dtype, device), rand((24,), dtype, device), 1, 1, 1, True)


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
    torch.testing.assert_close(gb.cpu().double(), passed.sum((0, 2, 3)), atol=_reduction_atol(dtype, plane), rtol=rtol)


# --------------------------------------------------------------------------- errors


def _args(device="cpu"):
    return rand((2, 4, 8, 8), torch.float32, device), rand((6, 4, 3, 3), torch.float32, device)


CALLS = {"wrapper": opforge.conv2d_3x3, "raw": torch.ops.opforge.conv2d_3x3}


# Exception types as F.conv2d raises them for what it refuses too
# (RuntimeError for shapes that do not fit), ValueError for values opforge
# does not support, TypeError for dtypes; the same message through the
# wrapper and the op.
@pytest.mark.parametrize("fn", ["wrapper", "raw"])
def test_errors(fn):
    def call(x, w, b=None, stride=1, padding=0, groups=1, activation=None):
        return CALLS[fn](x, w, b, stride, padding, groups, activation)

    x, w = _args()
    with pytest.raises(RuntimeError, match=r"x must be a 3-d \(C, H, W\) or 4-d \(N, C, H, W\) tensor, got 2-d"):
        call(x[0, 0], w)
    with pytest.raises(RuntimeError, match=r"x must be a 3-d .* got 5-d with shape \[1, 2, 4, 8, 8\]"):
        call(x[None], w)
    with pytest.raises(RuntimeError, match=r"weight must be a 4-d tensor, got 2-d"):
        call(x, w[:, :, 0, 0])
    with pytest.raises(ValueError, match=r"weight must have a 3x3 kernel .* got shape \[6, 4, 5, 5\]"):
        call(x, rand((6, 4, 5, 5)))
    with pytest.raises(
        RuntimeError, match=r"weight must have C/groups = 4 input channels .* got weight shape \[6, 3, 3, 3\]"
    ):
        call(x, rand((6, 3, 3, 3)))
    with pytest.raises(ValueError, match=r"groups must be 1 or the number of input channels \(4\), got 2"):
        call(x, rand((6, 2, 3, 3)), groups=2)
    with pytest.raises(RuntimeError, match=r"output channels \(6\) must be a positive multiple of groups \(4\)"):
        call(x, rand((6, 1, 3, 3)), groups=4)
    with pytest.raises(RuntimeError, match=r"output channels \(0\) must be a positive multiple of groups \(1\)"):
        call(x, rand((0, 4, 3, 3)))
    with pytest.raises(ValueError, match=r"stride must be 1 or 2, got 3"):
        call(x, w, stride=3)
    with pytest.raises(ValueError, match=r"stride must be 1 or 2, got 0"):
        call(x, w, stride=(0, 0))
    with pytest.raises(ValueError, match=r"padding must be 0 or 1, got 2"):
        call(x, w, padding=2)
    with pytest.raises(ValueError, match=r"stride must be an int or a pair of equal ints .* got \[1, 2\]"):
        call(x, w, stride=(1, 2))
    with pytest.raises(ValueError, match=r"stride must be an int or a pair of equal ints .* got \[1, 1, 1\]"):
        call(x, w, stride=[1, 1, 1])
    with pytest.raises(ValueError, match=r"padding must be an int or a pair of equal ints .* got \[0, 1\]"):
        call(x, w, padding=(0, 1))
    with pytest.raises(ValueError, match=r"padding must be 'same', 'valid', 0 or 1, got 'full'"):
        call(x, w, padding="full")
    with pytest.raises(ValueError, match=r"padding='same' is not supported for strided convolutions .* stride 2"):
        call(x, w, stride=2, padding="same")
    with pytest.raises(ValueError, match=r"stride must be an int or a pair of equal ints .* got \[2, 1\]"):
        call(x, w, stride=(2, 1), padding="same")
    with pytest.raises(
        ValueError, match=r"activation must be None, 'relu', 'relu6', 'hardswish' or 'silu', got 'gelu'"
    ):
        call(x, w, activation="gelu")
    with pytest.raises(
        ValueError, match=r"activation must be None, 'relu', 'relu6', 'hardswish' or 'silu', got 'gelu'"
    ):
        call(x, w, padding="same", activation="gelu")
    with pytest.raises(
        TypeError, match=r"x and weight must have the same dtype, got x torch.float32 and weight torch.float64"
    ):
        call(x, w.double())
    with pytest.raises(TypeError, match=r"x must be a float32, float64, float16 or bfloat16 tensor, got torch.int32"):
        call(x.int(), w)
    with pytest.raises(RuntimeError, match=r"bias must have shape \[6\], got \[5\]"):
        call(x, w, rand((5,)))
    with pytest.raises(RuntimeError, match=r"bias must have shape \[6\], got \[6, 1\]"):
        call(x, w, rand((6, 1)))
    with pytest.raises(TypeError, match=r"bias must have x's dtype torch.float32, got torch.float64"):
        call(x, w, rand((6,), torch.float64))
    with pytest.raises(RuntimeError, match=r"spatial size \(2, 8\) with padding 0 is smaller than the 3x3 kernel"):
        call(x[:, :, :2], w)
    with pytest.raises(RuntimeError, match=r"spatial size \(2, 8\) with padding 0 is smaller than the 3x3 kernel"):
        call(x[0, :, :2], w, padding="valid")


def test_errors_are_the_same_message():
    """The wrapper adds nothing: its message is the op's, word for word."""
    x, w = _args()
    messages = []
    for call in CALLS.values():
        with pytest.raises(RuntimeError) as info:
            call(x, rand((6, 3, 3, 3)))
        messages.append(str(info.value).splitlines()[0])
    assert messages[0] == messages[1]
    assert messages[0].startswith("opforge.conv2d_3x3: weight must have C/groups = 4 input channels")


def test_binding_errors_name_the_argument():
    """Arguments of the wrong Python type get torch's binding error, which
    names the argument and the type the schema expects."""
    x, w = _args()
    for call in CALLS.values():
        with pytest.raises(RuntimeError, match=r"weight"):
            call(x, [1.0])
        with pytest.raises(RuntimeError, match=r"stride"):
            call(x, w, None, 1.5)
        with pytest.raises(RuntimeError, match=r"activation"):
            call(x, w, None, 1, 0, 1, True)


@pytest.mark.cuda
def test_different_devices_raise():
    x, w = _args()
    for call in CALLS.values():
        with pytest.raises(
            RuntimeError, match=r"x and weight must be on the same device, got x on cpu and weight on cuda:0"
        ):
            call(x, w.cuda())
        with pytest.raises(RuntimeError, match=r"x and bias must be on the same device"):
            call(x.cuda(), w.cuda(), rand((6,)))
        with pytest.raises(RuntimeError, match=r"x and weight must be on the same device"):
            call(x.cuda(), w, None, 1, 0, 1, None)


def test_backward_op_errors():
    x, w = _args()
    g = rand((2, 6, 6, 6))
    bwd = torch.ops.opforge._conv2d_3x3_backward
    with pytest.raises(RuntimeError, match=r"grad_out must have shape \[2, 6, 6, 6\], got \[2, 6, 6, 5\]"):
        bwd(g[..., :5], None, x, w, 1, 0, 1, [True, True, True])
    with pytest.raises(RuntimeError, match=r"grad_out must have shape \[6, 6, 6\], got \[2, 6, 6, 6\]"):
        bwd(g, None, x[0], w, 1, 0, 1, [True, True, True])
    with pytest.raises(RuntimeError, match=r"result must have grad_out's shape"):
        bwd(g, g[..., :5], x, w, 1, 0, 1, [True, True, True])
    with pytest.raises(TypeError, match=r"grad_out must have x's dtype"):
        bwd(g.double(), None, x, w, 1, 0, 1, [True, True, True])
    with pytest.raises(ValueError, match=r"_conv2d_3x3_backward: stride must be 1 or 2, got 3"):
        bwd(g, None, x, w, 3, 0, 1, [True, True, True])


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
        torch.testing.assert_close(ours.cpu().double(), theirs, atol=_reduction_atol(dtype, plane), rtol=rtol)
    assert all(t.grad.dtype == dtype for t in (x1, w1, b1))
    assert x1.grad.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("padding", [0, 1])
@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("shape", [(3, 12, 37, 70), (2, 6, 8, 7), (1, 5, 3, 3), (2, 3, 4, 33), (1, 20, 9, 6)])
def test_depthwise_backward_stride2_cpu(dtype, padding, relu, channels_last, shape):
    """The CPU's direct stride-2 depthwise backward (NCHW: grad x from even
    and odd columns, weight sums on rows split the same way; NHWC: each
    pixel's taps along the channels, the weight window moving two columns;
    float32 NHWC goes to oneDNN): odd and even sizes, channel counts with and
    without a vector tail, both paddings, against float64."""
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
        torch.testing.assert_close(ours.double(), theirs, atol=_reduction_atol(dtype, plane), rtol=rtol)
    assert gx.dtype == dtype
    assert gx.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)


# (float32 channels_last at stride 2 goes through oneDNN, whose sums depend on
# the threads; bfloat16 takes this library's loops there)
@pytest.mark.parametrize(
    "channels_last,stride,dtype",
    [(False, 1, torch.float32), (True, 1, torch.float32), (False, 2, torch.float32), (True, 2, torch.bfloat16)],
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
    x2, w2 = (t.detach().double().cpu().requires_grad_() for t in (x, w))
    F.conv2d(x2, w2, None, 1, 1).backward(passed)
    atol, rtol = TOLERANCES[dtype]
    plane = n * h * wd
    torch.testing.assert_close(gb.cpu().double(), passed.sum((0, 2, 3)), atol=_reduction_atol(dtype, plane), rtol=rtol)
    # grad x and grad weight come from cuDNN (or ATen) given our masked
    # gradient: sums of 9 * K and N * H * W terms
    if dtype == torch.float32 and device == "cuda" and torch.backends.cudnn.allow_tf32:
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
        torch.testing.assert_close(gx.cpu().double(), x2.grad, atol=_reduction_atol(dtype, 9 * k), rtol=rtol)
        torch.testing.assert_close(gw.cpu().double(), w2.grad, atol=_reduction_atol(dtype, plane), rtol=rtol)
    assert gx.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)


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


# --------------------------------------------------------------------------- torch.library / compile / nn


@pytest.mark.parametrize("kind", ["dense", "depthwise"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("channels_last", [False, True])
def test_opcheck(kind, dtype, channels_last, device):
    c = 4
    groups = 1 if kind == "dense" else c
    x = rand((2, c, 7, 6), dtype, device)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    x.requires_grad_()
    w = rand((c, c // groups, 3, 3), dtype, device).requires_grad_()
    b = rand((c,), dtype, device).requires_grad_()
    torch.library.opcheck(torch.ops.opforge.conv2d_3x3.default, (x, w, b, 2, 1, groups, "relu"))
    torch.library.opcheck(torch.ops.opforge.conv2d_3x3.default, (x, w, None, (1, 1), [0, 0], groups, None))
    torch.library.opcheck(torch.ops.opforge.conv2d_3x3.padding, (x, w, b, 1, "same", groups, "relu"))
    # unbatched (C, H, W)
    torch.library.opcheck(torch.ops.opforge.conv2d_3x3.default, (x[0], w, b, 1, 1, groups, None))
    out = torch.ops.opforge.conv2d_3x3(x.detach(), w.detach(), b.detach(), 1, 1, groups, "relu")
    g = rand(out.shape, dtype, device)
    for mask in ([True, True, True], [False, True, False]):
        torch.library.opcheck(
            torch.ops.opforge._conv2d_3x3_backward.default,
            (g, out, x.detach(), w.detach(), 1, 1, groups, mask),
        )
    torch.library.opcheck(
        torch.ops.opforge._conv2d_3x3_backward.default,
        (g[0], None, x.detach()[0], w.detach(), 1, 1, groups, [True, True, True]),
    )


# --------------------------------------------------------------------------- drop-in for F.conv2d

# (stride, padding) as F.conv2d takes them, with what they mean here.
DROP_IN_ARGS = [
    ((1, 1), (1, 1)),
    ([2, 2], [0, 0]),
    ((1,), 1),
    (1, "same"),
    ((1, 1), "same"),
    (2, "valid"),
    (1, "valid"),
]


@pytest.mark.parametrize("stride,padding", DROP_IN_ARGS)
@pytest.mark.parametrize("kind", ["dense", "depthwise"])
@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("unbatched", [False, True])
def test_drop_in_for_f_conv2d(stride, padding, kind, relu, unbatched, device):
    """Arguments F.conv2d takes give F.conv2d's result: equal pairs, padding
    "same" / "valid", an unbatched (C, H, W) x (output (K, Ho, Wo))."""
    c = 4
    groups = 1 if kind == "dense" else c
    x = rand((c, 9, 10) if unbatched else (2, c, 9, 10), torch.float64, device)
    w, b = rand((6 if kind == "dense" else c, c // groups, 3, 3), torch.float64, device), rand((c,), torch.float64)
    b = b.to(device) if kind == "depthwise" else rand((6,), torch.float64, device)
    out = opforge.conv2d_3x3(x, w, b, stride, padding, groups, "relu" if relu else None)
    ref = F.conv2d(x, w, b, stride, padding, 1, groups)
    ref = torch.relu(ref) if relu else ref
    assert out.shape == ref.shape and out.is_contiguous()
    torch.testing.assert_close(out, ref)
    # the op itself takes them the same way
    raw = torch.ops.opforge.conv2d_3x3(x, w, b, stride, padding, groups, "relu" if relu else None)
    torch.testing.assert_close(raw, out, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["dense", "depthwise"])
@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("stride", [1, 2])
def test_unbatched_gradcheck(kind, relu, stride, device):
    c = 3
    groups = 1 if kind == "dense" else c
    x = rand((c, 6, 7), torch.float64, device).requires_grad_()
    w = rand((2 if kind == "dense" else c, c // groups, 3, 3), torch.float64, device).requires_grad_()
    b = rand((w.shape[0],), torch.float64, device).requires_grad_()
    fn = lambda x, w, b: opforge.conv2d_3x3(x, w, b, stride, 1, groups, "relu" if relu else None)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, w, b))
    out = fn(x, w, b)
    (gx,) = torch.autograd.grad(out.sum(), x)
    assert gx.shape == x.shape and gx.is_contiguous()


def _close_enough(a, b) -> bool:
    torch.testing.assert_close(a, b)  # the dtype's default tolerance
    return True


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("kind", ["dense", "depthwise"])
def test_backward_op_strided_operands(dtype, kind, device):
    """grad_out and result of any strides give the bits their contiguous
    copies give (an expanded gradient, a transposed view); an unbatched x
    that is not contiguous gets a contiguous gradient, F.conv2d's. The dense
    CUDA backward is cuDNN's, whose algorithm (and rounding) may follow the
    operands' strides: there the results agree within the dtype's tolerance."""
    groups = 1 if kind == "dense" else 4
    same = torch.equal if not (device == "cuda" and kind == "dense") else _close_enough
    x, w = rand((2, 4, 7, 6), dtype, device), rand((4, 4 // groups, 3, 3), dtype, device)
    out = opforge.conv2d_3x3(x, w, None, 1, 1, groups, "relu")
    g = rand((4, 2, 7, 6), dtype, device).transpose(0, 1)
    r = out.transpose(0, 1).contiguous().transpose(0, 1)
    bwd = torch.ops.opforge._conv2d_3x3_backward
    got = bwd(g, r, x, w, 1, 1, groups, [True] * 3)
    want = bwd(g.contiguous(), out, x, w, 1, 1, groups, [True] * 3)
    for a, b in zip(got, want):
        assert same(a, b)
    ones = torch.ones((), dtype=dtype, device=device).expand(out.shape)
    for a, b in zip(
        bwd(ones, out, x, w, 1, 1, groups, [True] * 3), bwd(ones.contiguous(), out, x, w, 1, 1, groups, [True] * 3)
    ):
        assert same(a, b)
    xu = rand((6, 7, 4), torch.float64, device).permute(2, 0, 1).requires_grad_()
    wd = w.double().detach().requires_grad_()
    gu = rand((4, 6, 7), torch.float64, device)
    gx = bwd(gu, None, xu.detach(), wd.detach(), 1, 1, groups, [True] * 3)[0]
    assert gx.shape == xu.shape and gx.is_contiguous()
    got = torch.autograd.grad(opforge.conv2d_3x3(xu, wd, None, 1, 1, groups), (xu, wd), gu)
    want = torch.autograd.grad(F.conv2d(xu, wd, None, 1, 1, 1, groups), (xu, wd), gu)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_padding_same_gradcheck(device):
    x = rand((2, 3, 6, 5), torch.float64, device).requires_grad_()
    w = rand((4, 3, 3, 3), torch.float64, device).requires_grad_()
    fn = lambda x, w: opforge.conv2d_3x3(x, w, None, (1, 1), "same", activation="relu")  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, w))


def test_no_grad_path_gives_no_graph(device):
    """Without a graph to record, the result is the kernel's (no grad_fn)."""
    x, w = rand((1, 4, 8, 8), device=device), rand((4, 4, 3, 3), device=device).requires_grad_()
    assert opforge.conv2d_3x3(x, w.detach()).grad_fn is None
    with torch.no_grad():
        assert opforge.conv2d_3x3(x, w).grad_fn is None
    assert opforge.conv2d_3x3(x, w).grad_fn is not None


def test_create_graph_first_derivatives_work(device):
    """create_graph=True is fine for first derivatives; only differentiating
    them again raises."""
    x = rand((1, 2, 5, 5), torch.float64, device).requires_grad_()
    w = rand((2, 2, 3, 3), torch.float64, device).requires_grad_()
    out = opforge.conv2d_3x3(x, w, None, 1, 1)
    gx, gw = torch.autograd.grad(out.sum(), (x, w), create_graph=True)
    ref = torch.autograd.grad(F.conv2d(x, w, None, 1, 1).sum(), (x, w))
    torch.testing.assert_close(gx, ref[0])
    torch.testing.assert_close(gw, ref[1])
    with pytest.raises(NotImplementedError, match=r"opforge.conv2d_3x3: double backward .* is not supported"):
        torch.autograd.grad(gw.sum(), w)


def test_compile_drop_in_arguments(device):
    """Unbatched x, pairs and padding strings under torch.compile(dynamic=True),
    forward and backward."""
    torch._dynamo.reset()

    def fn(x, w, b):
        y = opforge.conv2d_3x3(x, w, b, (1, 1), "same", activation="relu")
        return opforge.conv2d_3x3(y, w, b, 2, (1, 1))

    compiled = torch.compile(fn, fullgraph=True, dynamic=True)
    w, b = rand((4, 4, 3, 3), device=device).requires_grad_(), rand((4,), device=device).requires_grad_()
    for shape in ((4, 9, 9), (4, 12, 10), (2, 4, 9, 9)):
        x = rand(shape, device=device).requires_grad_()
        out = compiled(x, w, b)
        ref = fn(x, w, b)
        torch.testing.assert_close(out, ref)
        got = torch.autograd.grad(out.sum(), (x, w, b))
        want = torch.autograd.grad(ref.sum(), (x, w, b))
        for a, e in zip(got, want):
            torch.testing.assert_close(a, e)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = opforge.nn.Conv2d3x3(3, 8, padding=1, activation="relu")
        self.dw = opforge.nn.Conv2d3x3(8, 8, stride=2, padding=1, groups=8, activation="relu")
        self.pw = opforge.nn.Conv2d3x3(8, 4, padding=0)

    def forward(self, x):
        return self.pw(self.dw(self.stem(x)))


def test_compile_fullgraph_dynamic_no_recompiles(device):
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    model = Net().to(device)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=True)
    for batch, hw in ((2, 12), (3, 13), (5, 16)):
        x = rand((batch, 3, hw, hw), device=device)
        torch.testing.assert_close(compiled(x), model(x))
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} frames"


def test_compile_backward(device):
    torch._dynamo.reset()
    model = Net().to(device)
    compiled = torch.compile(model, fullgraph=True)
    x = rand((2, 3, 12, 12), device=device).requires_grad_()
    compiled(x).sum().backward()
    gx = x.grad.clone()
    x.grad = None
    model(x).sum().backward()
    torch.testing.assert_close(gx, x.grad)


def test_module_init_like_nn_conv2d():
    torch.manual_seed(3)
    ours = opforge.nn.Conv2d3x3(8, 16, stride=2, padding=1, groups=8)
    torch.manual_seed(3)
    ref = torch.nn.Conv2d(8, 16, 3, 2, 1, groups=8)
    assert torch.equal(ours.weight, ref.weight) and torch.equal(ours.bias, ref.bias)
    assert opforge.nn.Conv2d3x3(4, 4, bias=False).bias is None
    assert "activation=None" in repr(ours)


@pytest.mark.parametrize("groups,relu", [(1, True), (6, False), (6, True)])
def test_from_conv(groups, relu, device):
    conv = torch.nn.Conv2d(6, 12, 3, stride=2, padding=1, groups=groups).to(device)
    layer = opforge.nn.Conv2d3x3.from_conv(conv, relu=relu)
    x = rand((2, 6, 9, 9), device=device)
    ref = torch.relu(conv(x)) if relu else conv(x)
    torch.testing.assert_close(layer(x), ref, atol=1e-5 * _scale(6 // groups), rtol=1e-5)
    with pytest.raises(ValueError, match=r"3x3 kernel"):
        opforge.nn.Conv2d3x3.from_conv(torch.nn.Conv2d(2, 2, 5))
    with pytest.raises(ValueError, match=r"dilation 1"):
        opforge.nn.Conv2d3x3.from_conv(torch.nn.Conv2d(2, 2, 3, dilation=2))
    with pytest.raises(TypeError, match=r"must be a torch.nn.Conv2d"):
        opforge.nn.Conv2d3x3.from_conv(torch.nn.Linear(2, 2))


def test_module_takes_the_ops_arguments(device):
    """Conv2d3x3 takes stride and padding as conv2d_3x3 does, and refuses at
    construction what the op refuses, with the op's message."""
    layer = opforge.nn.Conv2d3x3(4, 6, stride=(1, 1), padding="same", activation="relu").to(device)
    x = rand((2, 4, 7, 7), device=device)
    torch.testing.assert_close(layer(x), torch.relu(F.conv2d(x, layer.weight, layer.bias, 1, "same")))
    assert layer(x[0]).shape == (6, 7, 7)
    with pytest.raises(ValueError, match=r"opforge.conv2d_3x3: stride must be 1 or 2, got 3"):
        opforge.nn.Conv2d3x3(4, 4, stride=3)
    with pytest.raises(ValueError, match=r"opforge.conv2d_3x3: stride must be an int or a pair of equal ints"):
        opforge.nn.Conv2d3x3(4, 4, stride=(1, 2))
    with pytest.raises(ValueError, match=r"groups must be 1 or the number of input channels \(4\), got 2"):
        opforge.nn.Conv2d3x3(4, 4, groups=2)
    with pytest.raises(
        ValueError, match=r"activation must be None, 'relu', 'relu6', 'hardswish' or 'silu', got 'gelu'"
    ):
        opforge.nn.Conv2d3x3(4, 4, activation="gelu")
    conv = torch.nn.Conv2d(4, 6, 3, padding="same").to(device)
    torch.testing.assert_close(opforge.nn.Conv2d3x3.from_conv(conv)(x), conv(x), atol=1e-5 * _scale(4), rtol=1e-5)


def test_module_trains(device):
    model = torch.nn.Sequential(Net(), torch.nn.Flatten(), torch.nn.LazyLinear(1)).to(device)
    x = rand((8, 3, 8, 8), device=device)
    y = (x.mean((1, 2, 3)) > 0).float()[:, None]
    model(x)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(15):
        loss = F.binary_cross_entropy_with_logits(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses[::5]


# --------------------------------------------------------------------------- CUDA specifics


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(4, 64, 56, 56), (2, 256, 28, 28), (2, 128, 112, 112), (1, 8, 300, 700)])
@pytest.mark.parametrize("channels_last", [False, True])
def test_cuda_depthwise_bench_shapes(dtype, shape, channels_last):
    x = rand(shape, dtype, "cuda")
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    c = shape[1]
    for stride in (1, 2):
        check(x, rand((c, 1, 3, 3), dtype, "cuda"), rand((c,), dtype, "cuda"), stride, 1, c, True)
    x1 = x.detach().clone().requires_grad_()
    w = rand((c, 1, 3, 3), dtype, "cuda").requires_grad_()
    out = opforge.conv2d_3x3(x1, w, None, 1, 1, c, "relu")
    g = rand(out.shape, dtype, "cuda")
    out.backward(g)
    x2, w2 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    torch.relu(F.conv2d(x2, w2, None, 1, 1, 1, c)).backward(g.double() * (out.detach() > 0).double())
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(x1.grad.double(), x2.grad, atol=atol * 3, rtol=rtol)
    n_terms = shape[0] * shape[2] * shape[3]
    torch.testing.assert_close(w.grad.double(), w2.grad, atol=atol * math.sqrt(n_terms), rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("stride", [1, 2])
def test_depthwise_multiplier_vector_paths(dtype, channels_last, stride, device):
    # Channel multiplier 2 with sizes that allow 16-byte accesses along W and C.
    x = rand((2, 16, 12, 32), dtype, device)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    check(x, rand((32, 1, 3, 3), dtype, device), rand((32,), dtype, device), stride, 1, 16, True)


@pytest.mark.cuda
@pytest.mark.parametrize("channels_last", [False, True])
def test_cuda_misaligned_and_offset_views(channels_last):
    # A storage offset of one element breaks 16-byte alignment although W and
    # C are multiples of the vector width: the kernels must take narrower accesses.
    shape = (2, 8, 10, 16)
    base = rand((2 * 8 * 10 * 16 + 1,), torch.float32, "cuda")
    if channels_last:
        x = base[1:].view(2, 10, 16, 8).permute(0, 3, 1, 2)
    else:
        x = base[1:].view(shape)
    assert x.data_ptr() % 16 != 0
    check(x, rand((8, 1, 3, 3), torch.float32, "cuda"), None, 1, 1, 8, True)
    check(x, rand((8, 8, 3, 3), torch.float32, "cuda"), rand((8,), torch.float32, "cuda"), 1, 1, 1, True)


@pytest.mark.cuda
def test_cuda_graph_capture_and_replay():
    x = rand((4, 32, 20, 20), device="cuda")
    w = rand((32, 1, 3, 3), device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        opforge.conv2d_3x3(x, w, None, 1, 1, 32, "relu")
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = opforge.conv2d_3x3(x, w, None, 1, 1, 32, "relu")
    x.copy_(rand((4, 32, 20, 20), device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.double().cpu(), reference(x, w, None, 1, 1, 32, True), atol=1e-5, rtol=1e-5)


# Stride-1 depthwise CUDA kernels: each case pins one of the host's tile
# choices (noted for a GPU of 132 SMs; every case is valid on any GPU).
S1_NCHW_CASES = [
    # (shape, multiplier, padding)
    ((2, 3, 56, 56), 1, 1),  # 16-byte row copies, V = 16 bytes, vector stores
    ((2, 3, 28, 28), 1, 1),  # half types: Wo % 8 != 0 -> V = 4, 8-byte row copies
    ((1, 4, 9, 30), 1, 0),  # 4-byte (half) / 8-byte (float) row copies; float V = 2
    ((1, 4, 7, 31), 1, 1),  # odd width: element (half) / 4-byte copies, scalar stores
    ((2, 1101, 10, 10), 1, 1),  # 4 planes per block, the last block with 2
    ((1, 3, 201, 1500), 1, 0),  # bands of rows (float32: 34 bands of 6, the last a single row)
    ((1, 2, 5, 13000), 1, 1),  # a row too wide to stage: the tiled fallback
    ((2, 5, 13, 20), 3, 1),  # channel multiplier 3 from one stage
    ((2, 5, 12, 16), 2, 0),  # multiplier 2, padding 0, vector stores
    ((1, 2, 3, 3), 1, 0),  # a 1x1 output
    ((1, 2, 3, 4), 1, 1),  # fewer columns than one vector
]

S1_NHWC_CASES = [
    # (shape, padding); small problems take tiles of 4-8 rows, (16, 64, 56, 56) of 14
    ((2, 32, 20, 20), 1),  # one 32-channel chunk, two tile columns of 10
    ((1, 64, 37, 17), 1),  # two chunks, partial last tiles (tile columns of 9 and 8)
    ((2, 40, 9, 12), 0),  # a partial channel chunk (8 of 32)
    ((1, 12, 8, 8), 1),  # C < 32: 8-byte copies for the half types
    ((1, 4, 5, 6), 0),  # C = 4
    ((1, 6, 8, 8), 1),  # C % 4 != 0: the tiled fallback
    ((1, 16, 40, 3), 1),  # one tile column of 3
    ((16, 64, 56, 56), 1),  # enough blocks for the full 16-row tiles (4 x 4 tiles of 14 x 14)
]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,mult,padding", S1_NCHW_CASES)
@pytest.mark.parametrize("relu", [False, True])
def test_cuda_depthwise_stride1_nchw_tiles(dtype, shape, mult, padding, relu):
    c = shape[1]
    x = rand(shape, dtype, "cuda")
    w = rand((c * mult, 1, 3, 3), dtype, "cuda")
    check(x, w, rand((c * mult,), dtype, "cuda"), 1, padding, c, relu)
    check(x, w, None, 1, padding, c, relu)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,padding", S1_NHWC_CASES)
@pytest.mark.parametrize("relu", [False, True])
def test_cuda_depthwise_stride1_nhwc_tiles(dtype, shape, padding, relu):
    c = shape[1]
    x = rand(shape, dtype, "cuda").to(memory_format=torch.channels_last)
    w = rand((c, 1, 3, 3), dtype, "cuda")
    check(x, w, rand((c,), dtype, "cuda"), 1, padding, c, relu)
    check(x, w, None, 1, padding, c, relu)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("channels_last", [False, True])
def test_cuda_depthwise_stride1_offset_views(dtype, channels_last):
    # One element of storage offset: 16-byte copies are off; float32 takes
    # 4-byte copies, bfloat16 element copies (NCHW) or the tiled fallback (NHWC).
    n, c, h, w = 2, 16, 12, 32
    base = rand((n * c * h * w + 1,), dtype, "cuda")
    if channels_last:
        x = base[1:].view(n, h, w, c).permute(0, 3, 1, 2)
    else:
        x = base[1:].view(n, c, h, w)
    assert x.data_ptr() % 16 != 0
    for padding in (0, 1):
        check(x, rand((c, 1, 3, 3), dtype, "cuda"), rand((c,), dtype, "cuda"), 1, padding, c, True)


@pytest.mark.cuda
@pytest.mark.parametrize("engine", ["cudnn", "opforge"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("channels_last", [False, True])
def test_cuda_dense_engines(engine, dtype, channels_last, monkeypatch):
    """Dense convolutions through cuDNN (the default: its fused kernel with ReLU)
    and through this library's tensor-core kernel (OPFORGE_CONV_DENSE_ENGINE=opforge)."""
    monkeypatch.setenv("OPFORGE_CONV_DENSE_ENGINE", engine)
    for stride, padding in CONFIGS:
        x = rand((2, 32, 13, 18), dtype, "cuda")
        if channels_last:
            x = x.to(memory_format=torch.channels_last)
        for relu in (True, False):
            check(x, rand((40, 32, 3, 3), dtype, "cuda"), rand((40,), dtype, "cuda"), stride, padding, 1, relu)
            check(x, rand((40, 32, 3, 3), dtype, "cuda"), None, stride, padding, 1, relu)


@pytest.mark.cuda
def test_cuda_dense_engine_bad_value(monkeypatch):
    monkeypatch.setenv("OPFORGE_CONV_DENSE_ENGINE", "fastest")
    x = rand((1, 8, 6, 6), torch.float32, "cuda")
    with pytest.raises(ValueError, match='OPFORGE_CONV_DENSE_ENGINE must be "cudnn" or "opforge", got "fastest"'):
        opforge.conv2d_3x3(x, rand((8, 8, 3, 3), torch.float32, "cuda"), None, activation="relu")
