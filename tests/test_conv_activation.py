"""conv2d_3x3's fused activations: relu6, hardswish and silu (relu: test_conv.py).

Forward bounds: conv_bounds.py. Gradients: the derivative is taken at
opforge's own z (or output) in float64, so a value right at a kink cannot
flip the comparison.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from conv_bounds import TORCH_ACT, assert_fused_conv_close, pre_activation
from reference import DTYPES, TOLERANCES, poisoned, rand

import opforge

ACTIVATIONS = ["relu6", "hardswish", "silu"]


def _geometry(kind, c):
    groups = 1 if kind == "dense" else c
    k = {"dense": 6, "depthwise": c, "depthwise_x2": 2 * c}[kind]
    return groups, k


def _operands(kind, dtype, device, channels_last, c=8):
    """(groups, x, weight, bias) of a small conv of `kind`: x (2, c, 11, 10)."""
    groups, k = _geometry(kind, c)
    x = rand((2, c, 11, 10), dtype, device)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    return groups, x, rand((k, c // groups, 3, 3), dtype, device), rand((k,), dtype, device)


def check_forward(x, w, b, stride, padding, groups, activation):
    with poisoned(x.device):
        out = opforge.conv2d_3x3(x, w, b, stride, padding, groups, activation)
    tf32 = x.device.type == "cuda" and x.dtype == torch.float32 and groups == 1 and torch.backends.cudnn.allow_tf32
    assert_fused_conv_close(out, x, w, b, stride, padding, groups, activation, tf32)
    return out


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("kind", ["dense", "depthwise", "depthwise_x2"])
@pytest.mark.parametrize("stride,padding", [(1, 0), (1, 1), (2, 0), (2, 1)])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward(activation, kind, stride, padding, channels_last, dtype, device):
    groups, x, w, b = _operands(kind, dtype, device, channels_last)
    check_forward(x, w, b, stride, padding, groups, activation)
    check_forward(x, w, None, stride, padding, groups, activation)


# Shapes that reach the larger-tile paths: CPU oneDNN (dense from 2^20
# multiply-adds), CUDA's staged depthwise kernels and tensor-core dense kernel.
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize(
    "shape,kind",
    [((1, 32, 20, 20), "dense"), ((2, 32, 56, 56), "depthwise"), ((4, 96, 14, 14), "depthwise")]
    # NCHW, 14x14 and 7x7 output planes over 1536 planes: oneDNN's depthwise on the CPU.
    + [((4, 384, 14, 14), "depthwise")],
)
@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_larger(activation, shape, kind, stride, channels_last, dtype, device):
    n, c, h, wd = shape
    groups, k = _geometry(kind, c)
    k = c if kind == "dense" else k
    x = rand(shape, dtype, device)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    w, b = rand((k, c // groups, 3, 3), dtype, device), rand((k,), dtype, device)
    check_forward(x, w, b, stride, 1, groups, activation)


@pytest.mark.cuda
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("channels_last", [False, True])
def test_cuda_dense_tensor_core_engine(activation, dtype, channels_last, monkeypatch):
    """The opforge tensor-core dense kernel fuses every activation in its epilogue."""
    monkeypatch.setenv("OPFORGE_CONV_DENSE_ENGINE", "opforge")
    x = rand((2, 16, 14, 14), dtype, "cuda")
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    w, b = rand((32, 16, 3, 3), dtype, "cuda"), rand((32,), dtype, "cuda")
    check_forward(x, w, b, 1, 1, 1, activation)
    got = torch.ops.opforge_bench.conv_dense_mma(x, w, b, 1, 1, False)
    z = pre_activation(x, w, b, 1, 1, 1)
    torch.testing.assert_close(got.cpu().double(), z, atol=TOLERANCES[dtype][0] * 12, rtol=TOLERANCES[dtype][1])


@pytest.mark.parametrize("activation", ["relu", *ACTIVATIONS])
@pytest.mark.parametrize("kind", ["dense", "depthwise"])
def test_nan_propagates(activation, kind, device):
    c = 4
    groups, k = _geometry(kind, c)
    x = rand((1, c, 6, 6), torch.float32, device)
    x[0, :, 2, 2] = float("nan")
    w = rand((k, c // groups, 3, 3), torch.float32, device)
    out = opforge.conv2d_3x3(x, w, None, 1, 1, groups, activation)
    ref = TORCH_ACT[activation](F.conv2d(x, w, None, 1, 1, 1, groups))
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    assert torch.isnan(out).any()


def _reference_grads(x, w, b, stride, padding, groups, activation, g):
    """float64 gradients of act(conv(x)) with act's derivative taken at
    opforge's own values: the output for relu6, z for hardswish and silu."""
    with torch.no_grad():
        if activation == "relu6":
            y = opforge.conv2d_3x3(x, w, b, stride, padding, groups, activation).cpu().double()
            grad_z = g.double().cpu() * ((y > 0) & (y < 6)).double()
        else:
            z = opforge.conv2d_3x3(x, w, b, stride, padding, groups, None).cpu().double().requires_grad_()
            with torch.enable_grad():
                TORCH_ACT[activation](z).backward(g.double().cpu())
            grad_z = z.grad
    x2, w2, b2 = (t.detach().double().cpu().requires_grad_() for t in (x, w, b))
    F.conv2d(x2, w2, b2, stride, padding, 1, groups).backward(grad_z)
    return x2.grad, w2.grad, b2.grad


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("kind", ["dense", "depthwise", "depthwise_x2"])
@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward(activation, kind, stride, channels_last, dtype, device):
    groups, x, w, b = _operands(kind, dtype, device, channels_last)
    x1, w1, b1 = (t.detach().clone().requires_grad_() for t in (x, w, b))
    out = opforge.conv2d_3x3(x1, w1, b1, stride, 1, groups, activation)
    g = rand(out.shape, dtype, device)
    with poisoned(device):
        out.backward(g)
    refs = _reference_grads(x, w, b, stride, 1, groups, activation, g)
    atol, rtol = TOLERANCES[dtype]
    if dtype == torch.float32 and device == "cuda" and groups == 1 and torch.backends.cudnn.allow_tf32:
        atol, rtol = 1e-3, 1e-3
    # grad z is rounded to the dtype before the convolution's sums (as torch's
    # activation backward followed by its conv backward does).
    terms_x = 9 * w.shape[0] // groups
    for ours, theirs, terms in ((x1.grad, refs[0], terms_x), (w1.grad, refs[1], 220), (b1.grad, refs[2], 220)):
        assert ours.dtype == dtype and ours.shape == theirs.shape
        torch.testing.assert_close(ours.cpu().double(), theirs, atol=atol * math.sqrt(terms), rtol=rtol)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("kind", ["dense", "depthwise"])
@pytest.mark.parametrize("stride", [1, 2])
def test_gradcheck(activation, kind, stride, device):
    c = 3
    groups, k = _geometry(kind, c)
    x = rand((2, c, 6, 5), torch.float64, device).requires_grad_()
    w = rand((k, c // groups, 3, 3), torch.float64, device).requires_grad_()
    b = rand((k,), torch.float64, device).requires_grad_()
    fn = lambda x, w, b: opforge.conv2d_3x3(x, w, b, stride, 1, groups, activation)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, w, b), eps=1e-6, atol=1e-5)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_backward_op_reads_the_named_activation(activation, device):
    """_conv2d_3x3_backward applies the named activation's derivative to `result`."""
    x = rand((1, 4, 7, 7), torch.float64, device)
    w = rand((4, 1, 3, 3), torch.float64, device)
    z = opforge.conv2d_3x3(x, w, None, 1, 1, 4, None)
    result = TORCH_ACT[activation](z) if activation == "relu6" else z
    g = rand(z.shape, torch.float64, device)
    gx, gw, gb = torch.ops.opforge._conv2d_3x3_backward(g, result, x, w, 1, 1, 4, [True] * 3, activation)
    zz = z.detach().clone().requires_grad_()
    TORCH_ACT[activation](zz).backward(g)
    gx_ref, gw_ref, gb_ref = torch.ops.opforge._conv2d_3x3_backward(zz.grad, None, x, w, 1, 1, 4, [True] * 3)
    for ours, theirs in ((gx, gx_ref), (gw, gw_ref), (gb, gb_ref)):
        torch.testing.assert_close(ours, theirs, atol=1e-12, rtol=1e-12)
    with pytest.raises(ValueError, match=r"_conv2d_3x3_backward: activation must be None, 'relu'.*got 'gelu'"):
        torch.ops.opforge._conv2d_3x3_backward(g, result, x, w, 1, 1, 4, [True] * 3, "gelu")


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_opcheck(activation, device):
    x = rand((2, 4, 7, 6), torch.float32, device).requires_grad_()
    w = rand((4, 1, 3, 3), torch.float32, device).requires_grad_()
    b = rand((4,), torch.float32, device).requires_grad_()
    torch.library.opcheck(torch.ops.opforge.conv2d_3x3.default, (x, w, b, 1, 1, 4, activation))
    wd = rand((6, 4, 3, 3), torch.float32, device).requires_grad_()
    torch.library.opcheck(torch.ops.opforge.conv2d_3x3.default, (x, wd, None, 2, 1, 1, activation))
    z = opforge.conv2d_3x3(x.detach(), w.detach(), b.detach(), 1, 1, 4, None)
    g = rand(z.shape, torch.float32, device)
    torch.library.opcheck(
        torch.ops.opforge._conv2d_3x3_backward.default,
        (g, z, x.detach(), w.detach(), 1, 1, 4, [True, True, True], activation),
    )


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_compile_fullgraph(activation, device):
    x = rand((2, 8, 12, 12), torch.float32, device)
    w, b = rand((8, 1, 3, 3), torch.float32, device), rand((8,), torch.float32, device)
    fn = torch.compile(lambda x: opforge.conv2d_3x3(x, w, b, 1, 1, 8, activation), fullgraph=True, dynamic=True)
    torch.testing.assert_close(fn(x), opforge.conv2d_3x3(x, w, b, 1, 1, 8, activation))
    w1 = w.clone().requires_grad_()
    f2 = torch.compile(lambda x: opforge.conv2d_3x3(x, w1, b, 1, 1, 8, activation).sum(), fullgraph=True)
    f2(x).backward()
    w2 = w.clone().requires_grad_()
    opforge.conv2d_3x3(x, w2, b, 1, 1, 8, activation).sum().backward()
    torch.testing.assert_close(w1.grad, w2.grad)


@pytest.mark.parametrize("activation", ["relu", *ACTIVATIONS])
def test_module_from_conv_keeps_memory_format(activation, device):
    conv = torch.nn.Conv2d(8, 8, 3, padding=1, groups=8).to(device).to(memory_format=torch.channels_last)
    layer = opforge.nn.Conv2d3x3.from_conv(conv, activation=activation)
    assert layer.weight.is_contiguous(memory_format=torch.channels_last)
    assert layer.weight.data_ptr() != conv.weight.data_ptr()
    x = rand((2, 8, 9, 9), torch.float32, device).to(memory_format=torch.channels_last)
    act = {
        "relu": torch.nn.ReLU(),
        "relu6": torch.nn.ReLU6(),
        "hardswish": torch.nn.Hardswish(),
        "silu": torch.nn.SiLU(),
    }
    torch.testing.assert_close(layer(x), act[activation](conv(x)), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="relu=True contradicts activation='silu'"):
        opforge.nn.Conv2d3x3.from_conv(conv, relu=True, activation="silu")
