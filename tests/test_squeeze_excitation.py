"""opforge.squeeze_excitation, opforge.nn.SqueezeExcitation and optimize's squeeze blocks."""

import copy

import pytest
import torch
import torch.nn.functional as F
from reference import randomize_batchnorm, saved_and_loaded

import opforge
from opforge import optimize_choice
from opforge.nn_squeeze_excitation import why_not_fusable

torchvision = pytest.importorskip("torchvision")
from torchvision.ops.misc import SqueezeExcitation as TorchvisionSE  # noqa: E402

ACTS = {"relu": F.relu, "relu6": F.relu6, "silu": F.silu, "hardswish": F.hardswish}
SCALES = {"sigmoid": torch.sigmoid, "hardsigmoid": F.hardsigmoid}
# The op's error against float64: products of C (then S) terms in the dtype's accumulation, the
# gate rounded once, and the output's rounding (half types).
TOL = {torch.float64: 1e-12, torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def reference(x, w1, b1, w2, b2, act, scale):
    """The block in float64."""
    d = [None if t is None else t.double().flatten(1) if t.dim() == 4 else t.double() for t in (w1, b1, w2, b2)]
    pooled = x.double().mean((-2, -1))
    hidden = ACTS[act](pooled @ d[0].T + (d[1] if d[1] is not None else 0))
    gate = SCALES[scale](hidden @ d[2].T + (d[3] if d[3] is not None else 0))
    return x.double() * gate[..., None, None]


def operands(c, s, dtype, device, conv_weights=True, bias=True):
    shape1, shape2 = ((s, c, 1, 1), (c, s, 1, 1)) if conv_weights else ((s, c), (c, s))
    w1 = torch.randn(shape1, dtype=dtype, device=device) / c**0.5
    w2 = torch.randn(shape2, dtype=dtype, device=device) / s**0.5
    b1 = torch.randn(s, dtype=dtype, device=device) if bias else None
    b2 = torch.randn(c, dtype=dtype, device=device) if bias else None
    return w1, b1, w2, b2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("act, scale", [("relu", "hardsigmoid"), ("silu", "sigmoid"), ("relu6", "sigmoid")])
def test_matches_float64(device, dtype, channels_last, act, scale):
    x = torch.randn(3, 24, 7, 5, dtype=dtype, device=device)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    w1, b1, w2, b2 = operands(24, 6, dtype, device)
    with torch.no_grad():
        out = opforge.squeeze_excitation(x, w1, b1, w2, b2, act, scale)
    ref = reference(x, w1, b1, w2, b2, act, scale)
    assert out.dtype == dtype and out.shape == x.shape and out.stride() == x.stride()
    torch.testing.assert_close(out.double(), ref, atol=TOL[dtype] * (ref.abs().max().item() + 1), rtol=0)


@pytest.mark.parametrize("conv_weights", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_weight_shapes_bias_and_unbatched(device, conv_weights, bias):
    w1, b1, w2, b2 = operands(8, 3, torch.float64, device, conv_weights, bias)
    for x in (torch.randn(2, 8, 4, 4, dtype=torch.float64, device=device), torch.randn(8, 4, 4, dtype=torch.float64)):
        x = x.to(device)
        out = opforge.squeeze_excitation(x, w1, b1, w2, b2, "hardswish", "hardsigmoid")
        ref = reference(x, w1, b1, w2, b2, "hardswish", "hardsigmoid")
        torch.testing.assert_close(out, ref.to(out.dtype), atol=1e-12, rtol=0)


def test_empty_batch(device):
    w1, b1, w2, b2 = operands(8, 3, torch.float32, device)
    out = opforge.squeeze_excitation(torch.randn(0, 8, 4, 4, device=device), w1, b1, w2, b2)
    assert out.shape == (0, 8, 4, 4)


@pytest.mark.parametrize("act, scale", [("relu", "hardsigmoid"), ("silu", "sigmoid"), ("hardswish", "sigmoid")])
def test_gradcheck_float64(device, act, scale):
    x = torch.randn(2, 6, 3, 4, dtype=torch.float64, device=device, requires_grad=True)
    params = [t.requires_grad_() for t in operands(6, 3, torch.float64, device)]
    assert torch.autograd.gradcheck(lambda *a: opforge.squeeze_excitation(*a, act, scale), (x, *params))


def test_no_grad_and_grad_paths_agree(device):
    """Without autograd the ReLU runs in the matrix product's epilogue and the activations in place."""
    x = torch.randn(2, 16, 5, 5, device=device)
    w1, b1, w2, b2 = operands(16, 4, torch.float32, device)
    with torch.no_grad():
        fast = opforge.squeeze_excitation(x, w1, b1, w2, b2, "relu", "hardsigmoid")
    recorded = opforge.squeeze_excitation(x.requires_grad_(), w1, b1, w2, b2, "relu", "hardsigmoid")
    torch.testing.assert_close(fast, recorded.detach())


def torchvision_block(c=16, s=4, scale=torch.nn.Hardsigmoid, activation=torch.nn.ReLU):
    return TorchvisionSE(c, s, activation=activation, scale_activation=scale)


def test_module_matches_torchvision_and_trains_alike(device):
    block = torchvision_block(activation=torch.nn.SiLU, scale=torch.nn.Sigmoid).double().to(device)
    fast = opforge.nn.SqueezeExcitation.from_module(block)
    assert fast.activation_name == "silu" and fast.scale_activation_name == "sigmoid"
    assert list(fast.state_dict()) == list(block.state_dict())
    x = torch.randn(2, 16, 6, 6, dtype=torch.float64, device=device).to(memory_format=torch.channels_last)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, ref = fast(xa), block(xb)
    assert out.stride() == ref.stride()
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    grad = torch.randn_like(ref)
    out.backward(grad)
    ref.backward(grad)
    torch.testing.assert_close(xa.grad, xb.grad, atol=1e-12, rtol=0)
    for (name, p), q in zip(fast.named_parameters(), block.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-12, rtol=0, msg=name)


def test_state_dict_round_trip_and_pickle():
    block = torchvision_block()
    fast = opforge.nn.SqueezeExcitation.from_module(block)
    other = torchvision_block()
    other.load_state_dict(fast.state_dict())  # loads into torchvision's block, and back
    fast.load_state_dict(other.state_dict())
    loaded = saved_and_loaded(fast)
    x = torch.randn(1, 16, 3, 3)
    torch.testing.assert_close(loaded(x), block(x))
    torch.testing.assert_close(copy.deepcopy(fast)(x), block(x))


def test_blocks_the_op_does_not_compute_are_refused():
    assert "scale_activation" in why_not_fusable(torchvision_block(scale=torch.nn.Tanh))
    assert "activation GELU" in why_not_fusable(torchvision_block(activation=torch.nn.GELU))
    block = torchvision_block()
    block.fc1 = torch.nn.Conv2d(16, 4, 1, groups=2)
    assert "1x1" in why_not_fusable(block)
    with pytest.raises(ValueError, match="from_module: .*1x1"):
        opforge.nn.SqueezeExcitation.from_module(block)
    with pytest.raises(ValueError, match="activation must be one of"):
        opforge.nn.SqueezeExcitation(8, 2, activation="gelu")


def test_bad_arguments():
    x = torch.randn(2, 8, 4, 4)
    w1, b1, w2, b2 = operands(8, 3, torch.float32, "cpu")
    with pytest.raises(ValueError, match="activation must be"):
        opforge.squeeze_excitation(x, w1, b1, w2, b2, "gelu")
    with pytest.raises(ValueError, match="scale_activation must be"):
        opforge.squeeze_excitation(x, w1, b1, w2, b2, "relu", "tanh")
    with pytest.raises(RuntimeError, match="x must be"):
        opforge.squeeze_excitation(x[0, 0], w1, b1, w2, b2)
    with pytest.raises(TypeError, match="x must be a float32"):
        opforge.squeeze_excitation(x.long(), w1, b1, w2, b2)
    with pytest.raises(TypeError, match="same dtype"):
        opforge.squeeze_excitation(x.double(), w1, b1, w2, b2)
    with pytest.raises(RuntimeError, match="fc1_weight must take x's 8 channels"):
        opforge.squeeze_excitation(x, w2, b1, w2, b2)
    with pytest.raises(RuntimeError, match="fc2_weight must be"):
        opforge.squeeze_excitation(x, w1, b1, w1, b2)
    with pytest.raises(RuntimeError, match="fc1_weight must be"):
        opforge.squeeze_excitation(x, torch.randn(3, 8, 3, 3), b1, w2, b2)
    with pytest.raises(RuntimeError, match="fc2_bias must be"):
        opforge.squeeze_excitation(x, w1, b1, w2, b1)


@pytest.mark.cuda
def test_tensors_on_two_devices_are_refused():
    x = torch.randn(2, 8, 4, 4, device="cuda")
    w1, b1, w2, b2 = operands(8, 3, torch.float32, "cpu")
    with pytest.raises(RuntimeError, match="same device"):
        opforge.squeeze_excitation(x, w1, b1, w2, b2)


def test_compile_fullgraph_and_export():
    block = opforge.nn.SqueezeExcitation.from_module(torchvision_block()).eval()
    x = torch.randn(2, 16, 5, 5)
    with torch.no_grad():
        ref = block(x)
        torch._dynamo.reset()
        torch.testing.assert_close(torch.compile(block, fullgraph=True)(x), ref)
    program = torch.export.export(block, (x,))
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert targets == {"opforge.squeeze_excitation.default"}, targets  # one node, run by opforge's library
    torch.testing.assert_close(program.module()(x), ref)
    # Decomposed, the program holds ATen's ops only.
    decomposed = program.run_decompositions()
    targets = {str(n.target) for n in decomposed.graph.nodes if n.op == "call_function"}
    assert targets and not any("opforge" in t for t in targets), targets
    torch.testing.assert_close(decomposed.module()(x), ref)


def test_optimize_replaces_timed_blocks_and_keeps_outputs(monkeypatch):
    model = randomize_batchnorm(torchvision.models.mobilenet_v3_small(num_classes=10)).eval()
    x = torch.randn(1, 3, 64, 64)
    monkeypatch.setattr(optimize_choice, "_cache", {})
    fast, report = opforge.optimize(model, example_inputs=(x,), report=True, force=False)
    rows = [r for r in report.layers if r.pattern.startswith("SqueezeExcitation")]
    assert len(rows) == sum(isinstance(m, TorchvisionSE) for m in model.modules()) > 0
    replaced = [r for r in rows if r.action == "one opforge.squeeze_excitation call"]
    assert all("measured" in r.reason for r in rows), str(report)
    assert sum(isinstance(m, opforge.nn.SqueezeExcitation) for m in fast.modules()) == len(replaced)
    with torch.no_grad():
        ref, out = model(x), fast(x)
    torch.testing.assert_close(out, ref, atol=1e-5 * ref.abs().max().item(), rtol=1e-5)
    for r in replaced:  # the block's state under the same names
        ours, theirs = fast.get_submodule(r.conv).state_dict(), model.get_submodule(r.conv).state_dict()
        assert list(ours) == list(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_optimize_force_replaces_every_block():
    model = randomize_batchnorm(torchvision.models.mobilenet_v3_small(num_classes=10)).eval()
    forced = opforge.optimize(model, force=True)
    assert not any(isinstance(m, TorchvisionSE) for m in forced.modules())
    assert any(isinstance(m, opforge.nn.SqueezeExcitation) for m in forced.modules())


def test_optimize_in_training_times_forward_and_backward_and_trains_alike(monkeypatch):
    """In training the op's gradients are autograd's through its ATen ops: one step matches."""
    model = randomize_batchnorm(torchvision.models.mobilenet_v3_small(num_classes=10)).double().train()
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    monkeypatch.setattr(optimize_choice, "_cache", {})
    fast, report = opforge.optimize(copy.deepcopy(model), example_inputs=(x,), report=True)
    rows = [r for r in report.layers if r.pattern.startswith("SqueezeExcitation")]
    assert rows and all("forward + backward" in r.reason for r in rows), str(report)
    assert all(p.grad is None for p in fast.parameters())  # the timing left the gradients alone
    fused = sum(isinstance(m, opforge.nn.SqueezeExcitation) for m in fast.modules())
    assert fused == sum(r.action != "left" for r in rows)
    for m in (model, fast):
        torch.manual_seed(0)  # the classifier's dropout draws the same mask in both
        m(x).square().mean().backward()
    # The op sums in another order than the 1x1 convs (a matrix product), and training BatchNorm
    # over a batch of two at this input's last stages (1x1 and 2x2 planes) amplifies that float64
    # rounding to 1e-11 of the largest gradient (seeds 0-2); a wrong gradient is off by far more.
    scale = max(p.grad.abs().max().item() for p in model.parameters())
    for (name, p), q in zip(model.named_parameters(), fast.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-9 * scale, rtol=1e-7, msg=name)


def test_optimize_leaves_hooked_and_subclassed_blocks():
    class Gated(TorchvisionSE):
        def forward(self, x):
            return super().forward(x) + x

    model = torch.nn.Sequential(torchvision_block(), Gated(16, 4)).eval()
    model[0].fc1.register_forward_hook(lambda *a: None)
    fast, report = opforge.optimize(model, force=True, report=True)
    assert type(fast[0]) is TorchvisionSE and type(fast[1]) is Gated
    rows = [r for r in report.layers if r.pattern.startswith("SqueezeExcitation")]
    assert len(rows) == 1 and "hooks" in rows[0].reason


def test_training_block_holds_the_models_parameters():
    """In training the fused block holds the block's own Parameter objects: an optimizer built on
    the model before optimize(..., inplace=True) steps them."""
    model = torch.nn.Sequential(TorchvisionSE(16, 4)).train()
    params = dict(model.named_parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fast = opforge.optimize(model, inplace=True, force=True)
    assert isinstance(fast[0], opforge.nn.SqueezeExcitation)
    assert {n: p for n, p in fast.named_parameters()}.keys() == params.keys()
    assert all(p is params[n] for n, p in fast.named_parameters())
    before = fast[0].fc1.weight.detach().clone()
    fast(torch.randn(2, 16, 5, 5)).square().sum().backward()
    opt.step()
    assert not torch.equal(fast[0].fc1.weight, before)
