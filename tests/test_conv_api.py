"""opforge.conv2d_3x3 as a torch op: torch.library checks, drop-in for F.conv2d, torch.compile, Conv2d3x3."""

import pytest
import torch
import torch.nn.functional as F
from conv_check import scale_for
from reference import rand

import opforge


@pytest.mark.parametrize("kind", ["dense", "depthwise"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("weight_channels_last", [False, True])
def test_opcheck(kind, dtype, channels_last, weight_channels_last, device):
    """weight_channels_last: a channels_last model's weight (grad weight then comes in its format)."""
    c = 4
    groups = 1 if kind == "dense" else c
    x = rand((2, c, 7, 6), dtype, device)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    x.requires_grad_()
    w = rand((c, c // groups, 3, 3), dtype, device)
    if weight_channels_last:
        w = w.to(memory_format=torch.channels_last)
    w.requires_grad_()
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
    torch.testing.assert_close(layer(x), ref, atol=1e-5 * scale_for(6 // groups), rtol=1e-5)
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
    torch.testing.assert_close(opforge.nn.Conv2d3x3.from_conv(conv)(x), conv(x), atol=1e-5 * scale_for(4), rtol=1e-5)


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
