"""conv2d_1x1: F.conv2d with a 1x1 weight (groups 1, no padding) and the activation fused.

Forward bounds: conv_bounds.py (R = 1). On CUDA, channels_last inputs with C a
multiple of the 16-byte chunk run the tensor-core GEMM; the tests also force
it for NCHW (OPFORGE_CONV_1X1_ENGINE=opforge) and ATen's path (=aten).
Gradients: the activation's derivative is taken at opforge's own output (or
pre-activation) in float64, so a value at a kink cannot flip the comparison.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from conv_bounds import LIPSCHITZ, TF32_PRODUCT_ERR, TORCH_ACT, UNIT, assert_fused_conv_close
from reference import DTYPES, TOLERANCES, poisoned, rand

import opforge

ACTIVATIONS = [None, "relu", "relu6", "hardswish", "silu"]


def _tf32(x):
    return x.device.type == "cuda" and x.dtype == torch.float32 and torch.backends.cudnn.allow_tf32


def check_forward(x, w, b, stride, activation):
    with poisoned(x.device):
        out = opforge.conv2d_1x1(x, w, b, stride, activation)
    assert_fused_conv_close(out, x, w, b, stride, 0, 1, activation, _tf32(x))
    fmt = torch.channels_last if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) else None
    if fmt is not None and x.shape[1] > 1:
        assert out.is_contiguous(memory_format=fmt)
    return out


def _operands(dtype, device, channels_last, shape=(2, 16, 11, 10), k=24):
    x = rand(shape, dtype, device)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    return x, rand((k, shape[1], 1, 1), dtype, device), rand((k,), dtype, device)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("stride", [1, 2, 3])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward(activation, stride, channels_last, dtype, device):
    x, w, b = _operands(dtype, device, channels_last)
    check_forward(x, w, b, stride, activation)
    check_forward(x, w, None, stride, activation)


# Layer shapes of mobilenet_v2 / resnet that fill the tensor-core kernel's larger tiles.
@pytest.mark.parametrize("activation", [None, "relu6", "silu"])
@pytest.mark.parametrize(
    "shape,k",
    [
        ((4, 24, 28, 28), 144),
        ((2, 320, 7, 7), 1280),
        ((8, 64, 14, 14), 64),
        ((2, 256, 9, 9), 40),
        ((2, 640, 7, 7), 160),
    ],
)
@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_forward_layer_shapes(activation, shape, k, stride, channels_last, dtype, device):
    x, w, b = _operands(dtype, device, channels_last, shape, k)
    check_forward(x, w, b, stride, activation)


@pytest.mark.cuda
@pytest.mark.parametrize("engine", ["opforge", "aten"])
@pytest.mark.parametrize("channels", [16, 12, 6])  # 12 and 6: not whole 16-byte chunks for half types
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_engines(engine, channels, channels_last, dtype, monkeypatch):
    """Each engine (and the fallback where the tensor-core kernel declines) gives the fused result."""
    monkeypatch.setenv("OPFORGE_CONV_1X1_ENGINE", engine)
    x, w, b = _operands(dtype, "cuda", channels_last, (3, channels, 13, 17), 40)
    for activation in ("relu6", "hardswish"):
        check_forward(x, w, b, 1, activation)
        check_forward(x, w, b, 2, activation)


@pytest.mark.cuda
def test_cuda_engine_name_is_checked(monkeypatch):
    monkeypatch.setenv("OPFORGE_CONV_1X1_ENGINE", "cudnn")
    x, w, b = _operands(torch.float32, "cuda", True)
    with pytest.raises(ValueError, match="OPFORGE_CONV_1X1_ENGINE must be"):
        opforge.conv2d_1x1(x, w, b)


@pytest.mark.cuda
def test_cuda_float32_without_tf32_is_exact_float32(monkeypatch):
    """With TF32 off for cuDNN, float32 keeps float32 products, as F.conv2d does."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    x, w, b = _operands(torch.float32, "cuda", True, (2, 64, 9, 9), 32)
    out = opforge.conv2d_1x1(x, w, b, 1, "relu")
    assert_fused_conv_close(out, x, w, b, 1, 0, 1, "relu", tf32=False)


# The CPU kernel runs a stride-1 layer whose pixels are rows of channels (channels_last, or a 1x1
# image), at most 1024 of them, with C >= K as one GEMM; these cases sit on both sides of each bound.
GEMM_BOUNDS = [
    ((1, 48, 14, 14), 16, True),  # GEMM: 196 pixels, C > K
    ((1, 32, 32, 32), 32, True),  # GEMM: 1024 pixels, C == K
    ((1, 32, 25, 41), 16, True),  # convolution: 1025 pixels
    ((1, 16, 14, 14), 32, True),  # convolution: C < K
    ((1, 48, 14, 14), 16, False),  # convolution: NCHW
    ((4, 40, 1, 1), 10, False),  # GEMM: a 1x1 image, 4 pixels, either format
    ((1, 40, 1, 1), 10, False),  # convolution: one pixel
]


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("case", GEMM_BOUNDS, ids=lambda c: f"{c[0]}-k{c[1]}-{'cl' if c[2] else 'nchw'}")
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemm_bounds(activation, case, dtype, device):
    shape, k, channels_last = case
    x, w, b = _operands(dtype, device, channels_last, shape, k)
    check_forward(x, w, b, 1, activation)
    check_forward(x, w, None, 1, activation)
    check_forward(x, w, b, 2, activation)  # stride 2 reads every other pixel: the convolution


def test_gemm_path_gradcheck(device):
    """The GEMM forward against the convolution's backward, in float64."""
    x = rand((2, 6, 3, 4), torch.float64, device).to(memory_format=torch.channels_last).requires_grad_()
    w = rand((4, 6, 1, 1), torch.float64, device).requires_grad_()
    b = rand((4,), torch.float64, device).requires_grad_()
    for activation in ACTIVATIONS:
        fn = lambda x, w, b, act=activation: opforge.conv2d_1x1(x, w, b, 1, act)  # noqa: E731
        assert torch.autograd.gradcheck(fn, (x, w, b), eps=1e-6, atol=1e-5)


def test_strided_unbatched_and_empty_inputs(device):
    x = rand((2, 16, 12, 20), torch.float32, device)[:, :, :, ::2]  # not contiguous in any format
    w, b = rand((8, 16, 1, 1), torch.float32, device), rand((8,), torch.float32, device)
    check_forward(x, w, b, 1, "relu")
    xu = rand((16, 7, 5), torch.float32, device)
    out = check_forward(xu, w, b, 2, "silu")
    assert out.shape == (8, 4, 3)
    for xe, we in (
        (torch.empty(0, 16, 5, 5, device=device), w),
        (torch.empty(3, 0, 5, 5, device=device), torch.empty(8, 0, 1, 1, device=device)),
    ):
        out = opforge.conv2d_1x1(xe, we, None, 1, "relu6")
        assert out.shape == F.conv2d(xe, we).shape


@pytest.mark.parametrize("activation", ACTIVATIONS[1:])
def test_nan_propagates(activation, device):
    x = rand((1, 8, 6, 6), torch.float32, device).to(memory_format=torch.channels_last)
    x[0, :, 2, 2] = float("nan")
    w = rand((16, 8, 1, 1), torch.float32, device)
    out = opforge.conv2d_1x1(x, w, None, 1, activation)
    ref = TORCH_ACT[activation](F.conv2d(x, w))
    assert torch.equal(torch.isnan(out), torch.isnan(ref)) and torch.isnan(out).any()


def test_bad_arguments_name_what_is_wrong(device):
    x, w, b = _operands(torch.float32, device, False)
    cases = [
        ((x, rand((24, 16, 3, 3), torch.float32, device), b, 1, None), ValueError, "weight must have a 1x1 kernel"),
        ((x, rand((24, 8, 1, 1), torch.float32, device), b, 1, None), RuntimeError, "weight must have 16 input"),
        ((x, w.double(), b, 1, None), TypeError, "x and weight must have the same dtype"),
        ((x, w, rand((5,), torch.float32, device), 1, None), RuntimeError, r"bias must have shape \[24\]"),
        ((x, w, b.half(), 1, None), TypeError, "bias must have x's dtype"),
        ((x, w, b, 0, None), ValueError, "stride must be at least 1"),
        ((x, w, b, (1, 2), None), ValueError, "stride must be an int or a pair of equal ints"),
        ((x, w, b, 1, "gelu"), ValueError, "activation must be None, 'relu'"),
        ((x[0, 0], w, b, 1, None), RuntimeError, "x must be a 3-d"),
        ((x.int(), w, b, 1, None), TypeError, "x"),
        ((x[:, :, :0], w, b, 1, None), RuntimeError, "smaller than the 1x1 kernel"),
    ]
    for args, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            opforge.conv2d_1x1(*args)


def _reference_grads(x, w, b, stride, activation, g):
    """float64 gradients of act(conv1x1(x)) with act's derivative at opforge's own values."""
    with torch.no_grad():
        if activation in ("relu", "relu6"):
            y = opforge.conv2d_1x1(x, w, b, stride, activation).cpu().double()
            grad_z = g.double().cpu() * ((y > 0) & (y < 6 if activation == "relu6" else y == y)).double()
        elif activation is None:
            grad_z = g.double().cpu()
        else:
            z = opforge.conv2d_1x1(x, w, b, stride, None).cpu().double().requires_grad_()
            with torch.enable_grad():
                TORCH_ACT[activation](z).backward(g.double().cpu())
            grad_z = z.grad
    x2, w2, b2 = (t.detach().double().cpu().requires_grad_() for t in (x, w, b))
    F.conv2d(x2, w2, b2, stride).backward(grad_z)
    return x2.grad, w2.grad, b2.grad


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward(activation, stride, channels_last, dtype, device):
    x, w, b = _operands(dtype, device, channels_last)
    x1, w1, b1 = (t.detach().clone().requires_grad_() for t in (x, w, b))
    out = opforge.conv2d_1x1(x1, w1, b1, stride, activation)
    g = rand(out.shape, dtype, device)
    with poisoned(device):
        out.backward(g)
    refs = _reference_grads(x, w, b, stride, activation, g)
    atol, rtol = TOLERANCES[dtype]
    # grad x sums K products per element; grad weight and bias sum over N*Ho*Wo pixels.
    pixels = out.shape[0] * out.shape[2] * out.shape[3]
    terms = (w.shape[0], pixels, pixels)
    if _tf32(x):
        # TF32 products (cuDNN's backward, as for F.conv2d): a worst-case bound from the sums of
        # absolute products, the same gradients of |x|, |w| and |grad z|.
        grad_abs = _reference_grads(x.abs(), w.abs(), b.abs(), stride, None, g.abs() * LIPSCHITZ)
        for ours, theirs, abs_sum, n in zip((x1.grad, w1.grad, b1.grad), refs, grad_abs, terms, strict=True):
            bound = abs_sum * (TF32_PRODUCT_ERR + (n + 2) * UNIT[torch.float32]) + theirs.abs() * UNIT[dtype]
            err = (ours.cpu().double() - theirs).abs()
            assert (err <= bound + 1e-30).all(), f"max err/bound {(err / bound).max().item():.3f}"
        return
    for ours, theirs, n in zip((x1.grad, w1.grad, b1.grad), refs, terms, strict=True):
        assert ours.dtype == dtype and ours.shape == theirs.shape
        torch.testing.assert_close(ours.cpu().double(), theirs, atol=atol * math.sqrt(n), rtol=rtol)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("stride", [1, 2])
def test_gradcheck(activation, stride, device):
    x = rand((2, 3, 6, 5), torch.float64, device).requires_grad_()
    w = rand((4, 3, 1, 1), torch.float64, device).requires_grad_()
    b = rand((4,), torch.float64, device).requires_grad_()
    fn = lambda x, w, b: opforge.conv2d_1x1(x, w, b, stride, activation)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, w, b), eps=1e-6, atol=1e-5)


@pytest.mark.parametrize("activation", [None, "relu", "relu6"])
def test_second_derivatives(activation, device):
    """The backward is ATen's, so it is differentiable where torch's activation backward is."""
    x = rand((2, 3, 5, 4), torch.float64, device).requires_grad_()
    w = rand((4, 3, 1, 1), torch.float64, device).requires_grad_()
    b = rand((4,), torch.float64, device).requires_grad_()
    fn = lambda x, w, b: opforge.conv2d_1x1(x, w, b, 1, activation)  # noqa: E731
    assert torch.autograd.gradgradcheck(fn, (x, w, b), eps=1e-6, atol=1e-5)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_opcheck(activation, device):
    x = rand((2, 8, 7, 6), torch.float32, device).requires_grad_()
    w = rand((16, 8, 1, 1), torch.float32, device).requires_grad_()
    b = rand((16,), torch.float32, device).requires_grad_()
    torch.library.opcheck(torch.ops.opforge.conv2d_1x1.default, (x, w, b, 1, activation))
    xc = x.detach().to(memory_format=torch.channels_last).requires_grad_()
    torch.library.opcheck(torch.ops.opforge.conv2d_1x1.default, (xc, w, None, 2, activation))


@pytest.mark.parametrize("activation", ["relu6", "silu"])
def test_compile_fullgraph(activation, device):
    x = rand((2, 8, 12, 12), torch.float32, device).to(memory_format=torch.channels_last)
    w, b = rand((16, 8, 1, 1), torch.float32, device), rand((16,), torch.float32, device)
    fn = torch.compile(lambda x: opforge.conv2d_1x1(x, w, b, 1, activation), fullgraph=True, dynamic=True)
    torch.testing.assert_close(fn(x), opforge.conv2d_1x1(x, w, b, 1, activation))
    w1 = w.clone().requires_grad_()
    f2 = torch.compile(lambda x: opforge.conv2d_1x1(x, w1, b, 2, activation).sum(), fullgraph=True)
    f2(x).backward()
    w2 = w.clone().requires_grad_()
    opforge.conv2d_1x1(x, w2, b, 2, activation).sum().backward()
    torch.testing.assert_close(w1.grad, w2.grad)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_module_from_conv(activation, device):
    conv = torch.nn.Conv2d(8, 16, 1, stride=2).to(device).to(memory_format=torch.channels_last)
    layer = opforge.nn.Conv2d1x1.from_conv(conv, activation=activation)
    assert layer.weight.is_contiguous(memory_format=torch.channels_last)
    assert layer.weight.data_ptr() != conv.weight.data_ptr() and layer.weight.device == conv.weight.device
    x = rand((2, 8, 9, 9), torch.float32, device).to(memory_format=torch.channels_last)
    with torch.no_grad():
        assert_fused_conv_close(layer(x), x, conv.weight, conv.bias, 2, 0, 1, activation, _tf32(x))
    assert "activation=" in repr(layer)
    fresh = opforge.nn.Conv2d1x1(8, 16, 2, bias=False, activation=activation, device=device)
    assert fresh.weight.shape == (16, 8, 1, 1) and fresh.bias is None


def test_module_refuses_what_it_cannot_run():
    for conv in (torch.nn.Conv2d(8, 8, 3), torch.nn.Conv2d(8, 8, 1, groups=2), torch.nn.Conv2d(8, 8, 1, padding=1)):
        with pytest.raises(ValueError, match="1x1 kernel, groups 1 and no padding"):
            opforge.nn.Conv2d1x1.from_conv(conv)
    with pytest.raises(TypeError, match="must be a torch.nn.Conv2d"):
        opforge.nn.Conv2d1x1.from_conv(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="activation must be None"):
        opforge.nn.Conv2d1x1(8, 8, activation="tanh")
