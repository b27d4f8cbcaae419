"""opforge.batch_norm_act and nn.BatchNormAct2d: a training-mode BatchNorm2d -> activation in one call.

Checked against torch's BatchNorm2d and activation modules run in float64 (output, running
statistics, num_batches_tracked, gradients of x and the BatchNorm's weight and bias), every fresh
output poisoned; where no own engine takes the input (float64), equal to the modules bit for bit."""

import copy

import pytest
import torch
from batch_norm_cases import ACTIVATIONS, BATCH_NORMS, JUMP_WIDTH, TOLERANCE, away_from_jumps_of, random_batch_norm
from reference import poisoned

import opforge


def make_batch_norm(channels, dtype, bn, device):
    """A training BatchNorm2d with random affine parameters and running statistics (never 0 / 1)."""
    norm, float_params = random_batch_norm(channels, bn)
    return norm.to(device=device, dtype=torch.float32 if float_params else dtype)


def check_against_float64(bn, x, activation):
    """BatchNormAct2d on a copy of bn against bn and the activation in float64."""
    dtype = x.dtype
    ref = torch.nn.Sequential(copy.deepcopy(bn), ACTIVATIONS[activation]()).double()
    mine = opforge.nn.BatchNormAct2d.of(copy.deepcopy(bn), activation)
    x64 = x.detach().double().requires_grad_()
    xi = x.detach().clone().requires_grad_()
    with poisoned(x.device):
        out = mine(xi)
        with torch.no_grad():
            z = copy.deepcopy(ref[0])(x64)
        grad = torch.randn(out.shape, dtype=dtype, device=x.device)
        grad = grad * away_from_jumps_of(z, activation, JUMP_WIDTH[dtype]).to(dtype)
        out.backward(grad)
    expected = ref(x64)
    expected.backward(grad.double())
    assert out.dtype == dtype and out.stride() == x.stride()
    pairs = [("out", out, expected), ("x.grad", xi.grad, x64.grad)]
    pairs += [(f"{n}.grad", p.grad, q.grad) for n, p, q in zip(("weight", "bias"), mine.parameters(), ref.parameters())]
    for name in ("running_mean", "running_var"):
        pairs.append((name, getattr(mine, name), getattr(ref[0], name)))
    for name, actual, wanted in pairs:
        assert (actual is None) == (wanted is None), name
        if actual is not None:
            scale = max(wanted.abs().max().item(), 1.0)
            torch.testing.assert_close(
                actual.double(), wanted, rtol=0, atol=TOLERANCE[dtype] * scale, msg=lambda m, n=name: f"{n}: {m}"
            )
    if mine.track_running_stats:
        assert int(mine.num_batches_tracked) == int(ref[0].num_batches_tracked) == 1


@pytest.mark.parametrize("bn", list(BATCH_NORMS))
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_against_float64(dtype, channels_last, activation, bn, device):
    if dtype == torch.float32 and bn == "float_params":
        pytest.skip("the same as affine")
    torch.manual_seed(0)
    norm = make_batch_norm(20, dtype, BATCH_NORMS[bn], device)  # a full vector and a partial one
    x = (torch.randn(3, 20, 9, 11, device=device) * 1.5 + 0.5).to(dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    check_against_float64(norm, x, activation)


class _PreciseHardswish(torch.autograd.Function):
    """ATen's CUDA hardswish multiplies by a float 1/6; the op keeps float64's
    precision there (the composite) and takes torch's derivative."""

    @staticmethod
    def forward(ctx, z):
        ctx.save_for_backward(z)
        return z * torch.clamp(z + 3, 0, 6) / 6

    @staticmethod
    def backward(ctx, grad):
        return torch.ops.aten.hardswish_backward(grad, ctx.saved_tensors[0])


def _float64_hardswish(z, device):
    return _PreciseHardswish.apply(z) if device == "cuda" else torch.nn.functional.hardswish(z)


FLOAT64_ACTIVATIONS = {
    "relu": lambda z, device: torch.relu(z),
    "relu6": lambda z, device: torch.nn.functional.relu6(z),
    "silu": lambda z, device: torch.nn.functional.silu(z),
    "hardswish": _float64_hardswish,
}


@pytest.mark.parametrize("activation", list(FLOAT64_ACTIVATIONS))
def test_float64_equals_the_modules_exactly(activation, device):
    torch.manual_seed(1)
    bn = make_batch_norm(6, torch.float64, {}, device)
    x = torch.randn(2, 6, 5, 7, dtype=torch.float64, device=device)
    mine, ref = opforge.nn.BatchNormAct2d.of(copy.deepcopy(bn), activation), copy.deepcopy(bn)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, expected = mine(x1), FLOAT64_ACTIVATIONS[activation](ref(x2), device)
    assert torch.equal(out, expected)
    out.square().sum().backward()
    expected.square().sum().backward()
    assert torch.equal(x1.grad, x2.grad) and torch.equal(mine.weight.grad, ref.weight.grad)
    assert torch.equal(mine.running_var, ref.running_var)


def test_eval_mode_runs_the_running_statistics():
    bn = make_batch_norm(6, torch.float32, {}, "cpu").eval()
    mine = opforge.nn.BatchNormAct2d.of(copy.deepcopy(bn), "relu6")
    x = torch.randn(2, 6, 5, 5)
    assert torch.equal(mine(x), torch.nn.functional.relu6(bn(x)))
    assert torch.equal(mine.running_mean, bn.running_mean)


def test_without_weight_grad_and_without_affine():
    """Only x's gradient asked for; a BatchNorm without weight and bias (the gradient indices shift)."""
    torch.manual_seed(2)
    for bn in (make_batch_norm(8, torch.float32, {}, "cpu").requires_grad_(False),
               make_batch_norm(8, torch.float32, dict(affine=False), "cpu")):  # fmt: skip
        x = torch.randn(2, 8, 6, 6, requires_grad=True)
        ref_x = x.detach().clone().requires_grad_()
        opforge.nn.BatchNormAct2d.of(copy.deepcopy(bn), "silu")(x).sum().backward()
        torch.nn.functional.silu(copy.deepcopy(bn)(ref_x)).sum().backward()
        torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-4, atol=1e-5)


def test_bad_arguments_name_the_argument():
    x, c = torch.randn(2, 4, 3, 3), torch.ones(4)
    with pytest.raises(RuntimeError, match="x must be a 4-d tensor"):
        opforge.batch_norm_act(torch.randn(2, 4, 3), None, None, None, None)
    with pytest.raises(RuntimeError, match=r"weight must have shape \[4\]"):
        opforge.batch_norm_act(x, torch.ones(3), None, None, None)
    with pytest.raises(ValueError, match="running_mean and running_var must be given together"):
        opforge.batch_norm_act(x, None, None, c.clone(), None)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        opforge.batch_norm_act(torch.randn(1, 4, 1, 1), None, None, None, None)
    with pytest.raises(ValueError, match="activation must be"):
        opforge.batch_norm_act(x, None, None, None, None, activation="gelu")
    with pytest.raises(TypeError, match="x must be a float32, float64, float16 or bfloat16 tensor"):
        opforge.batch_norm_act(x.long(), None, None, None, None)
    with pytest.raises(ValueError, match="activation must be"):
        opforge.nn.BatchNormAct2d.of(torch.nn.BatchNorm2d(4), "tanh")


def test_state_dict_names_and_compile():
    """The module is the BatchNorm: its state_dict keys; under torch.compile it runs as the modules."""
    bn = make_batch_norm(6, torch.float32, {}, "cpu")
    mine = opforge.nn.BatchNormAct2d.of(copy.deepcopy(bn), "relu")
    assert list(mine.state_dict()) == list(bn.state_dict())
    x = torch.randn(2, 6, 5, 5)
    compiled = torch.compile(copy.deepcopy(mine), backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), torch.relu(copy.deepcopy(bn)(x)), rtol=1e-5, atol=1e-6)
