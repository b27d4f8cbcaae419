"""opforge.conv2d_batch_norm with a residual: ``act(bn(conv(x)) + residual)``, a residual block's tail.

Where the op runs torch's kernels (the CPU, float64, a residual laid out
unlike the conv output) it must equal the modules; on the CUDA engine
(channels_last) every output and gradient is compared with the modules run
in float64."""

import copy

import pytest
import torch
from batch_norm_cases import ACTIVATIONS, JUMP_WIDTH, TOLERANCE, away_from_jumps_of
from reference import cudnn_flags, poisoned, randomize_batchnorm

import opforge


@pytest.fixture(autouse=True)
def full_float32_convs():
    """The conv in float32 (no TF32): the comparisons are with float64."""
    with cudnn_flags(allow_tf32=False):
        yield


def block_of(channels, dtype, device, activation, channels_last, bias=False, bn_dtype=None):
    conv = torch.nn.Conv2d(8, channels, 3, padding=1, bias=bias)
    block = torch.nn.Sequential(conv, torch.nn.BatchNorm2d(channels, momentum=0.3), ACTIVATIONS[activation]())
    with torch.no_grad():
        randomize_batchnorm(block)
    block = block.to(device).train()
    block[0].to(dtype)
    block[1].to(bn_dtype or dtype)
    if channels_last:
        block = block.to(memory_format=torch.channels_last)
    return block


def modules_forward(block, x, residual):
    """What the op replaces: the modules, the add between the BatchNorm and the activation."""
    return block[2](block[1](block[0](x)) + residual)


def op_forward(block, x, residual, activation):
    conv, bn = block[0], block[1]
    return opforge.conv2d_batch_norm(
        x, conv.weight, conv.bias, bn.weight, bn.bias, bn.running_mean, bn.running_var, bn.num_batches_tracked,
        conv.stride, conv.padding, conv.dilation, conv.groups, bn.momentum, bn.eps, activation, residual,
    )  # fmt: skip


def run(forward, block, x, residual, grad):
    """forward on copies of the inputs: (output, x's, residual's and the parameters' gradients, buffers)."""
    x = x.detach().clone().requires_grad_()
    residual = residual.detach().clone().requires_grad_()
    out = forward(block, x, residual)
    out.backward(grad.to(out.dtype))
    return [out, x.grad, residual.grad, *[p.grad for p in block.parameters()], *block.buffers()]


def inputs(block, dtype, device, channels_last, residual_layout=None, rows=(4, 12, 10)):
    n, h, w = rows
    x = torch.randn(n, 8, h, w, dtype=dtype, device=device)
    residual = torch.randn(n, block[0].out_channels, h, w, dtype=dtype, device=device) * 1.5
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = x.contiguous(memory_format=fmt)
    residual = residual.contiguous(memory_format=residual_layout or fmt)
    return x, residual


def check_against_float64(block, activation, x, residual):
    """The op (outputs poisoned first) against the modules in float64 on the CPU, within the dtype's
    tolerance; the gradient zero where the pre-activation is near a jump of the activation's derivative."""
    ref_block = copy.deepcopy(block).double().cpu()
    with torch.no_grad():
        z = copy.deepcopy(ref_block)[:2](x.double().cpu()) + residual.double().cpu()
    grad = torch.randn(z.shape, dtype=torch.float64)
    grad *= away_from_jumps_of(z, activation, JUMP_WIDTH[x.dtype])
    expected = run(modules_forward, ref_block, x.double().cpu(), residual.double().cpu(), grad)
    with poisoned(x.device):
        actual = run(lambda b, xx, rr: op_forward(b, xx, rr, activation), block, x, residual, grad.to(x.device))
    assert actual[0].stride() == block.to(x.device)[0](x).stride()  # the conv output's layout
    for a, e in zip(actual, expected):
        assert (a is None) == (e is None)
        if a is None:
            continue
        if not e.is_floating_point():  # num_batches_tracked
            assert torch.equal(a.cpu(), e)
            continue
        scale = max(e.abs().max().item(), 1.0)
        # The input's dtype sets the precision: float32 BatchNorm parameters under a bfloat16
        # input get gradients of bfloat16 data.
        tolerance = TOLERANCE[x.dtype]
        torch.testing.assert_close(a.double().cpu(), e, rtol=0, atol=tolerance * scale)


@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
def test_against_float64(device, activation, dtype, channels_last):
    torch.manual_seed(0)
    # No conv bias: before a training BatchNorm its gradient is 0 up to rounding, which another
    # engine's rounding does not match (the float64 test covers the bias).
    block = block_of(16, dtype, device, activation, channels_last)
    check_against_float64(block, activation, *inputs(block, dtype, device, channels_last))


@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_float64_equals_the_modules_exactly(activation):
    """torch's kernels (ATen's batch norm, the add in place, the activation): bit for bit on the CPU."""
    device = "cpu"
    torch.manual_seed(1)
    block = block_of(16, torch.float64, device, activation, channels_last=False, bias=True)
    x, residual = inputs(block, torch.float64, device, channels_last=False)
    grad = torch.randn(4, 16, 12, 10, dtype=torch.float64, device=device)
    mine = copy.deepcopy(block)
    expected = run(modules_forward, block, x, residual, grad)
    actual = run(lambda b, xx, rr: op_forward(b, xx, rr, activation), mine, x, residual, grad)
    for a, e in zip(actual, expected):
        assert torch.equal(a, e)


@pytest.mark.cuda
@pytest.mark.parametrize("channels", [7, 20, 96, 2304])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_engine_channel_counts(channels, dtype):
    """One-element, 8-byte and 16-byte accesses and more than one block of channels; BatchNorm
    parameters in float32 under a bfloat16 input; every activation over the cases."""
    torch.manual_seed(channels)
    for i, activation in enumerate(ACTIVATIONS):
        if (i + channels) % 2:
            continue
        bn_dtype = torch.float32 if dtype == torch.bfloat16 and i % 4 == 0 else None
        block = block_of(channels, dtype, "cuda", activation, channels_last=True, bn_dtype=bn_dtype)
        x, residual = inputs(block, dtype, "cuda", channels_last=True, rows=(6, 17, 13))
        check_against_float64(block, activation, x, residual)


@pytest.mark.parametrize("activation", ["relu", "silu"])
def test_residual_of_another_layout(device, activation):
    """An NCHW residual beside a channels_last conv output (the CUDA engine walks both as one array:
    this one goes through torch's add)."""
    torch.manual_seed(2)
    block = block_of(16, torch.float32, device, activation, channels_last=True)
    x, residual = inputs(block, torch.float32, device, channels_last=True, residual_layout=torch.contiguous_format)
    check_against_float64(block, activation, x, residual)


@pytest.mark.parametrize("activation", [None, "relu", "hardswish"])
def test_only_some_gradients_asked(device, activation):
    """The residual's gradient alone (conv and BatchNorm frozen, x without grad), and every gradient
    but the residual's."""
    torch.manual_seed(3)
    block = block_of(16, torch.float32, device, activation, channels_last=True).requires_grad_(False)
    x, residual = inputs(block, torch.float32, device, channels_last=True)
    grad = torch.randn(4, 16, 12, 10, device=device)
    r1, r2 = residual.clone().requires_grad_(), residual.clone().requires_grad_()
    modules_forward(copy.deepcopy(block), x, r1).backward(grad)
    op_forward(copy.deepcopy(block), x, r2, activation).backward(grad)
    torch.testing.assert_close(r2.grad, r1.grad, rtol=1e-5, atol=1e-5)
    block.requires_grad_(True)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    modules_forward(copy.deepcopy(block), x1, residual).backward(grad)
    op_forward(copy.deepcopy(block), x2, residual, activation).backward(grad)
    torch.testing.assert_close(x2.grad, x1.grad, rtol=1e-4, atol=1e-4)


def test_gradcheck_float64():
    x = torch.randn(2, 3, 5, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 3, 3, 3, dtype=torch.float64, requires_grad=True)
    g, beta = (torch.randn(4, dtype=torch.float64, requires_grad=True) for _ in range(2))
    r = torch.randn(2, 4, 5, 5, dtype=torch.float64, requires_grad=True)
    for activation in ACTIVATIONS:

        def fn(x, w, g, beta, r, activation=activation):
            return opforge.conv2d_batch_norm(x, w, None, g, beta, None, None, padding=1, activation=activation,
                                             residual=r)  # fmt: skip

        assert torch.autograd.gradcheck(fn, (x, w, g, beta, r))


@pytest.mark.parametrize("activation", ["relu", None])
def test_opcheck(device, activation):
    """Schema, autograd registration, fake tensors and AOT dispatch with the residual given."""
    x = torch.randn(2, 3, 6, 6, device=device, requires_grad=True)
    w = torch.randn(4, 3, 3, 3, device=device, requires_grad=True)
    g, b = (torch.randn(4, device=device, requires_grad=True) for _ in range(2))
    r = torch.randn(2, 4, 6, 6, device=device, requires_grad=True)
    stats = (torch.zeros(4, device=device), torch.ones(4, device=device), torch.tensor(0, device=device))
    args = (x, w, None, g, b, *stats, [1, 1], [1, 1], [1, 1], 1, 0.1, 1e-5, activation, r)
    torch.library.opcheck(torch.ops.opforge.conv2d_batch_norm.default, args)


def test_bad_residual_is_named():
    block = block_of(16, torch.float32, "cpu", "relu", channels_last=False)
    x, residual = inputs(block, torch.float32, "cpu", channels_last=False)
    with pytest.raises(ValueError, match=r"residual must have the conv output's shape \[4, 16, 12, 10\]"):
        op_forward(block, x, residual[:, :8], "relu")
    with pytest.raises(TypeError, match="residual must have the conv output's dtype torch.float32, got torch.float64"):
        op_forward(block, x, residual.double(), "relu")


@pytest.mark.cuda
def test_residual_on_another_device_is_named():
    block = block_of(16, torch.float32, "cuda", "relu", channels_last=True)
    x, residual = inputs(block, torch.float32, "cuda", channels_last=True)
    with pytest.raises(RuntimeError, match="residual"):
        op_forward(block, x, residual.cpu(), "relu")


@pytest.mark.parametrize("training", [True, False])
def test_module_takes_the_residual(training):
    """ConvBatchNorm2d(x, residual): the op in training, torch's modules in eval mode."""
    torch.manual_seed(4)
    block = block_of(16, torch.float32, "cpu", "relu", channels_last=False).train(training)
    x, residual = inputs(block, torch.float32, "cpu", channels_last=False)
    ref = copy.deepcopy(block)
    mine = copy.deepcopy(block)
    layer = opforge.nn.ConvBatchNorm2d.of(mine[0], opforge.nn.BatchNormInConv.of(mine[1]), "relu")
    torch.testing.assert_close(layer(x, residual), modules_forward(ref, x, residual), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mine[1].running_var, ref[1].running_var, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(layer(x), ref[2](ref[1](ref[0](x))), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "shortcut",
    [lambda r: r[:1, :, :1, :1], lambda r: r.double()],
    ids=["broadcast", "promoted"],
)
def test_module_adds_what_the_op_does_not_take_as_the_modules_do(shortcut):
    """A shortcut that broadcasts or promotes: the module adds it after the batch norm, as the modules do
    (the op itself takes only the conv output's shape and dtype)."""
    block = block_of(16, torch.float32, "cpu", "relu", channels_last=False)
    x, residual = inputs(block, torch.float32, "cpu", channels_last=False)
    residual = shortcut(residual)
    ref, mine = copy.deepcopy(block), copy.deepcopy(block)
    layer = opforge.nn.ConvBatchNorm2d.of(mine[0], opforge.nn.BatchNormInConv.of(mine[1]), "relu")
    got, want = layer(x, residual), modules_forward(ref, x, residual)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mine[1].running_mean, ref[1].running_mean, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("activation", [None, "relu", "silu"])
def test_residual_changed_in_place_after_the_forward(activation):
    """The modules' add keeps nothing of the residual for the backward; neither does the op where its
    backward does not read it (here: torch's kernels on the CPU), so an in-place change after the
    forward is allowed and the gradients are those of the modules."""
    block = block_of(16, torch.float32, "cpu", activation, channels_last=False)
    x, residual = inputs(block, torch.float32, "cpu", channels_last=False)
    grads = []
    for forward in (modules_forward, lambda b, xx, r: op_forward(b, xx, r, activation)):
        b = copy.deepcopy(block)
        source = residual.detach().clone().requires_grad_()
        shortcut = source * 1
        out = forward(b, x, shortcut)
        shortcut.mul_(2)
        out.sum().backward()
        grads.append([source.grad, *[p.grad for p in b.parameters()]])
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
