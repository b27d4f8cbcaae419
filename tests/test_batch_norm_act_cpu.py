"""opforge.conv2d_batch_norm on its own CPU batch norm + activation engine (csrc/cpu/batch_norm_act_*).

The engine sums in another order than ATen's, so each result is checked against the three torch
modules run in float64: output, running statistics, num_batches_tracked and the gradients of x,
the conv's weight and bias and the BatchNorm's weight and bias, every fresh output poisoned."""

import copy

import pytest
import torch
from batch_norm_cases import ACTIVATIONS, BATCH_NORMS, JUMP_WIDTH, TOLERANCE, away_from_jumps_of, random_batch_norm
from reference import poisoned

import opforge
from opforge.ops.conv_batch_norm import why_not_own_engine


def make_block(channels_in, channels, dtype, activation, bn, channels_last, bias=True):
    """Conv2d -> BatchNorm2d (train) -> activation with random BatchNorm tensors (never 0 / 1)."""
    conv = torch.nn.Conv2d(channels_in, channels, 3, padding=1, bias=bias)
    norm, float_params = random_batch_norm(channels, bn)
    block = torch.nn.Sequential(conv, norm, ACTIVATIONS[activation]()).train()
    if bias:
        with torch.no_grad():
            conv.bias.uniform_(-1.0, 2.0)
    block[0].to(dtype)
    block[1].to(torch.float32 if float_params else dtype)
    if channels_last:
        block = block.to(memory_format=torch.channels_last)
    return block


def call_op(block, x, activation):
    conv, bn = block[0], block[1]
    return opforge.conv2d_batch_norm(
        x, conv.weight, conv.bias, bn.weight, bn.bias, bn.running_mean, bn.running_var, bn.num_batches_tracked,
        conv.stride, conv.padding, conv.dilation, conv.groups, bn.momentum, bn.eps, activation,
    )  # fmt: skip


def away_from_jumps(ref_block, x64, activation, width):
    with torch.no_grad():
        z = copy.deepcopy(ref_block)[:2](x64)
    return away_from_jumps_of(z, activation, width)


def check_against_float64(block, x, activation, grad=None):
    """The op on a copy of block (x's dtype) against block in float64; returns the op's output."""
    dtype = x.dtype
    ref_block = copy.deepcopy(block).double()
    mine = copy.deepcopy(block)
    with torch.no_grad():
        conv_out = block[0](x)
    assert why_not_own_engine(conv_out, block[1]) == ""  # the CPU engine takes this layer
    x64 = x.detach().double().requires_grad_()
    xi = x.detach().clone().requires_grad_()
    with poisoned():
        out = call_op(mine, xi, activation)
        if grad is None:
            grad = torch.randn(out.shape, dtype=dtype)
        grad = grad * away_from_jumps(ref_block, x64, activation, JUMP_WIDTH[dtype]).to(dtype)
        out.backward(grad)
    ref = ref_block(x64)
    ref.backward(grad.double())
    assert out.dtype == dtype and out.stride() == conv_out.stride()
    pairs = [("out", out, ref), ("x.grad", xi.grad, x64.grad)]
    names = ["conv.weight", "conv.bias", "bn.weight", "bn.bias"]
    params = list(mine[0].parameters()) + list(mine[1].parameters())
    ref_params = list(ref_block[0].parameters()) + list(ref_block[1].parameters())
    pairs += [(f"{n}.grad", p.grad, q.grad) for n, p, q in zip(names, params, ref_params)]
    for name in ("running_mean", "running_var"):
        pairs.append((name, getattr(mine[1], name), getattr(ref_block[1], name)))
    for name, actual, expected in pairs:
        assert (actual is None) == (expected is None), name
        if actual is None:
            continue
        tol = TOLERANCE[dtype]
        scale = max(expected.abs().max().item(), 1.0)
        if name == "conv.bias.grad":
            # 0 in exact arithmetic (a bias before a training BatchNorm): rounding noise summed over
            # the batch, of the size of the conv weight's gradient (a sum over as many values).
            scale = max(scale, ref_block[0].weight.grad.abs().max().item())
        torch.testing.assert_close(
            actual.double(), expected, rtol=0, atol=tol * scale, msg=lambda m, n=name: f"{n}: {m}"
        )
    if mine[1].track_running_stats:
        assert int(mine[1].num_batches_tracked) == int(ref_block[1].num_batches_tracked) == 1
    return out


@pytest.mark.parametrize("bn", list(BATCH_NORMS))
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_engine_against_float64(dtype, channels_last, activation, bn):
    if dtype == torch.float32 and bn == "float_params":
        pytest.skip("the same as affine")
    torch.manual_seed(0)
    # 20 channels: full vectors and a partial one (8- and 16-float lanes).
    block = make_block(6, 20, dtype, activation, BATCH_NORMS[bn], channels_last)
    x = (torch.randn(3, 6, 9, 11) * 1.5 + 0.5).to(dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    check_against_float64(block, x, activation)


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("channels", [3, 80])
def test_engine_large_and_strided_grad(channels_last, channels):
    """Several tasks and row blocks (more than one thread's grain), many rows per flush of the float
    lanes, a channel mean far from zero (a bias of 40), and a gradient of other strides than the output."""
    torch.manual_seed(1)
    block = make_block(4, channels, torch.float32, "hardswish", {}, channels_last)
    with torch.no_grad():
        block[0].bias.fill_(40.0)
    x = torch.randn(4, 4, 48, 40) * 2.0 - 1.0
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    grad = torch.randn(4, channels, 40, 48).transpose(2, 3)  # neither NCHW nor channels_last
    check_against_float64(block, x, "hardswish", grad=grad)


@pytest.mark.parametrize("shape", [(1, 32, 14, 14), (1, 1280, 2, 2), (1, 24, 28, 28)])
def test_engine_batch_one(shape):
    torch.manual_seed(2)
    block = make_block(shape[1], shape[1], torch.float32, "relu6", {}, True)
    x = torch.randn(*shape).contiguous(memory_format=torch.channels_last)
    check_against_float64(block, x, "relu6")


def test_mask_without_bn_weight_grad():
    """Only x's gradient asked for (the BatchNorm's parameters frozen)."""
    block = make_block(6, 20, torch.float32, "silu", {}, False)
    block[1].requires_grad_(False)
    x = torch.randn(2, 6, 7, 7, requires_grad=True)
    out = call_op(copy.deepcopy(block), x, "silu")
    out.sum().backward()
    ref_x = x.detach().clone().requires_grad_()
    block(ref_x).sum().backward()
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-4, atol=1e-5)


def test_float64_runs_aten_exactly():
    torch.manual_seed(3)
    block = make_block(6, 20, torch.float64, "relu6", {}, True)
    x = torch.randn(2, 6, 8, 8, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        assert why_not_own_engine(block[0](x), block[1]) == "float64"
    mine = copy.deepcopy(block)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, ref = call_op(mine, x1, "relu6"), block(x2)
    assert torch.equal(out, ref)
    out.square().sum().backward()
    ref.square().sum().backward()
    assert torch.equal(x1.grad, x2.grad)
    assert torch.equal(mine[1].running_var, block[1].running_var)
