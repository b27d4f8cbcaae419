"""Residual tails and shared activations: optimize's block-level rewrites and opforge.nn.ConvResidual."""

import copy
import random

import pytest
import torch
import torch.nn.functional as F
from conv_bounds import TORCH_ACT
from reference import randomize_batchnorm, saved_and_loaded

import opforge
from opforge import nn_prepacked_ops
from opforge.nn_prepacked import onednn_runs
from opforge.optimize_residual import engines_for

torchvision = pytest.importorskip("torchvision")
ACTIVATIONS = ["relu", "relu6", "hardswish", "silu", None]


def reference(conv, x, r, activation):
    """act(conv(x) + r) in float64."""
    b = None if conv.bias is None else conv.bias.double()
    z = F.conv2d(x.double(), conv.weight.double(), b, conv.stride, conv.padding, conv.dilation, conv.groups)
    return TORCH_ACT[activation](z + r.double())


def tolerance(dtype, conv):
    # Sums of conv.weight[0].numel() products in float32; half types round the output once (and
    # oneDNN's bfloat16 path the sum before the add).
    terms = conv.weight[0].numel()
    return {torch.float64: 1e-12, torch.float32: 1e-6 * terms, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]


def make(dtype, channels_last, device="cpu", stride=1, groups=1, activation="relu", engine="torch", nchw_weight=False):
    """The conv, its ConvResidual, an input and a residual; ``nchw_weight``: the weight stays NCHW
    while the tensors are channels_last (an NCHW model run channels_last inside)."""
    conv = torch.nn.Conv2d(8, 8, 3, stride=stride, padding=1, groups=groups).eval().to(device, dtype)
    x = torch.randn(2, 8, 13, 11, dtype=dtype, device=device)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    conv = conv.to(memory_format=torch.contiguous_format if nchw_weight else fmt)
    x = x.contiguous(memory_format=fmt)
    with torch.no_grad():
        shape = conv(x).shape
    r = torch.randn(shape, dtype=dtype, device=device).contiguous(memory_format=fmt)
    layer = opforge.nn.ConvResidual.from_conv(conv, activation=activation, engine=engine)
    return conv, layer, x, r


def check_engine(engine, dtype, channels_last, device, activation="relu", stride=1, groups=1, nchw_weight=False):
    conv, layer, x, r = make(dtype, channels_last, device, stride, groups, activation, engine, nchw_weight)
    with torch.no_grad():
        out = layer(x, r)
        torch_out = conv(x)
    if nchw_weight:  # the weight's channels_last copy is made once, the parameter keeps its format
        # A depthwise weight (C, 1, 3, 3) is already both formats: no copy is needed.
        needs_copy = not layer.weight.is_contiguous(memory_format=torch.channels_last)
        assert layer.weight.is_contiguous()
        assert (nn_prepacked_ops.cached_channels_last(layer.weight) is not None) == needs_copy
    ref = reference(conv, x, r, activation)
    assert out.dtype == dtype and out.shape == ref.shape
    assert out.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    assert out.stride() == torch_out.stride()
    scale = ref.abs().max().item() + 1
    torch.testing.assert_close(out.double(), ref, atol=tolerance(dtype, conv) * scale, rtol=0)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_torch_engine_matches_float64(activation, channels_last, dtype):
    check_engine("torch", dtype, channels_last, "cpu", activation)


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("stride, groups", [(1, 1), (2, 1), (1, 8)])
def test_add_relu_engine_matches_float64(channels_last, dtype, stride, groups):
    check_engine("add_relu", dtype, channels_last, "cpu", "relu", stride, groups)


@pytest.mark.parametrize("activation", ["relu", None])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_onednn_engine_matches_float64(activation, channels_last, dtype):
    if not onednn_runs(dtype):
        pytest.skip(f"oneDNN does not run {dtype} on this CPU")
    conv, layer, x, r = make(dtype, channels_last, activation=activation, engine="onednn")
    with torch.no_grad():
        layer(x, r)
    assert layer._packed is not None  # the oneDNN path ran, not the fallback
    check_engine("onednn", dtype, channels_last, "cpu", activation)


@pytest.mark.cuda
@pytest.mark.parametrize("engine", ["torch", "add_relu", "cudnn"])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("stride, groups", [(1, 1), (2, 1), (1, 8)])
def test_cuda_engines_match_float64(engine, channels_last, dtype, stride, groups):
    torch.backends.cudnn.allow_tf32 = False
    try:
        check_engine(engine, dtype, channels_last, "cuda", "relu", stride, groups)
    finally:
        torch.backends.cudnn.allow_tf32 = True


@pytest.mark.cuda
@pytest.mark.parametrize("engine", ["torch", "add_relu", "cudnn"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("stride, groups", [(1, 1), (2, 1), (1, 8)])
def test_cuda_engines_with_nchw_weight_and_channels_last_inputs(engine, dtype, stride, groups):
    torch.backends.cudnn.allow_tf32 = False
    try:
        check_engine(engine, dtype, True, "cuda", "relu", stride, groups, nchw_weight=True)
    finally:
        torch.backends.cudnn.allow_tf32 = True


@pytest.mark.parametrize("engine", ["torch", "add_relu", "onednn"])
def test_training_and_broadcast_residuals_fall_back_to_torch(engine):
    if engine == "onednn" and not onednn_runs(torch.float32):
        pytest.skip("this torch build has no oneDNN")
    conv, layer, x, r = make(torch.float64 if engine != "onednn" else torch.float32, False, engine=engine)
    # A residual that broadcasts (one per channel) is added as torch adds it.
    r1 = r[:1, :, :1, :1].clone()
    with torch.no_grad():
        torch.testing.assert_close(layer(x, r1), F.relu(conv(x) + r1))
    # With gradients recorded, the fused engines' graphs are torch's: the same gradients.
    x = x.detach().requires_grad_()
    layer(x, r).sum().backward()
    got = (x.grad.clone(), layer.weight.grad.clone())
    x.grad = None
    F.relu(F.conv2d(x, layer.weight, layer.bias, 1, 1) + r).sum().backward()
    torch.testing.assert_close(got[0], x.grad)


def test_onednn_engine_follows_the_input_shape_from_call_to_call():
    """The output shape a residual must match is kept for the last input shape: a new input shape
    (another batch, another image size) is checked against its own."""
    if not onednn_runs(torch.float32):
        pytest.skip("this torch build has no oneDNN")
    conv, layer, x, r = make(torch.float32, True, engine="onednn")
    with torch.no_grad():
        for n, hw in ((2, 8), (3, 8), (2, 12), (2, 8)):
            xi = torch.randn(n, x.shape[1], hw, hw).contiguous(memory_format=torch.channels_last)
            ri = torch.randn(n, r.shape[1], hw, hw).contiguous(memory_format=torch.channels_last)
            torch.testing.assert_close(layer(xi, ri), F.relu(conv(xi) + ri), atol=1e-4, rtol=1e-4)
            weight, bias = layer._weight_bias()
            assert layer._output_sizes(xi, weight) == tuple(ri.shape)
            fits = layer._fused_call_fits(xi, ri, weight, bias)
            assert fits and not layer._fused_call_fits(xi, ri[:, :, :-1], weight, bias)
    assert layer._packed is not None  # oneDNN ran


def test_bad_engines_name_the_argument():
    conv = torch.nn.Conv2d(4, 4, 3, padding=1)
    with pytest.raises(ValueError, match="engine must be one of"):
        opforge.nn.ConvResidual.from_conv(conv, activation="relu", engine="tensorrt")
    with pytest.raises(ValueError, match="fuses ReLU only"):
        opforge.nn.ConvResidual.from_conv(conv, activation="silu", engine="add_relu")
    with pytest.raises(ValueError, match="fuses ReLU or none"):
        opforge.nn.ConvResidual.from_conv(conv, activation="hardswish", engine="onednn")


def test_engines_offered_per_device_and_activation():
    conv, layer, x, r = make(torch.float32, False)
    offered = engines_for(layer, x)
    assert "add_relu" in offered and "cudnn" not in offered
    assert ("onednn" in offered) == onednn_runs(torch.float32)
    _, silu_layer, _, _ = make(torch.float32, False, activation="silu")
    assert not engines_for(silu_layer, x)  # neither fused engine applies a SiLU after the add


@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
def test_resnet_blocks_are_rewritten_and_keep_outputs(name):
    model = randomize_batchnorm(getattr(torchvision.models, name)(num_classes=10)).eval()
    x = torch.randn(2, 3, 64, 64)
    fast, report = opforge.optimize(model, example_inputs=(x,), report=True)
    assert type(fast) is type(model)
    tails = [m for m in fast.modules() if isinstance(m, opforge.nn.ConvResidual)]
    assert len(tails) == sum(len(layer) for layer in (model.layer1, model.layer2, model.layer3, model.layer4))
    rows = [r for r in report.layers if "shortcut add" in r.action]
    assert len(rows) == len(tails), str(report)
    assert all(r.reason.startswith("measured") for r in rows), str(report)
    # Every tail folds its BatchNorm. The blocks' other chains fold theirs too (each ReLU call has a
    # module of its own now), unless the folded conv timed slower, which the report then says.
    kept = [r for r in report.layers if "BatchNorm2d" in r.pattern and "BatchNorm folded" not in r.action]
    assert all("BatchNorm not folded" in r.reason for r in kept), str(report)
    assert sum(isinstance(m, torch.nn.BatchNorm2d) for m in fast.modules()) == len(kept), str(report)
    # The folded BatchNorms and fused ReLUs stay as attributes but the blocks no longer call them.
    blocks = [m for m in fast.modules() if isinstance(m, torch.fx.GraphModule)]
    assert len(blocks) == len(tails)
    # Plain attributes of the block and of its class stay readable.
    assert fast.layer1[0].stride == 1 and fast.layer1[0].expansion == type(model.layer1[0]).expansion
    for block in blocks:
        called = [block.get_submodule(n.target) for n in block.graph.nodes if n.op == "call_module"]
        assert not any(isinstance(m, torch.nn.Identity) for m in called), block.code
        assert any(isinstance(m, torch.nn.Identity) for m in block.modules())
    with torch.no_grad():
        ref = model(x)
        torch.testing.assert_close(fast(x), ref, atol=2e-4 * ref.abs().max().item(), rtol=2e-4)


def test_forced_resnet_uses_fused_add_relu_and_keeps_outputs():
    model = randomize_batchnorm(torchvision.models.resnet18(num_classes=10)).eval()
    x = torch.randn(2, 3, 48, 48)
    fast, report = opforge.optimize(model, report=True, force=True)
    tails = [m for m in fast.modules() if isinstance(m, opforge.nn.ConvResidual)]
    assert tails and all(t.engine == "add_relu" for t in tails), str(report)
    with torch.no_grad():
        ref = model(x)
        torch.testing.assert_close(fast(x), ref, atol=2e-4 * ref.abs().max().item(), rtol=2e-4)


def test_state_dict_copies_pickle_compile_and_export():
    model = randomize_batchnorm(torchvision.models.resnet18(num_classes=10)).eval()
    x = torch.randn(1, 3, 32, 32)
    fast = opforge.optimize(model, example_inputs=(x,))
    state = fast.state_dict()
    assert "layer1.0.conv2.weight" in state and "layer1.0.conv2.bias" in state
    assert not any(k.startswith("layer1.0.bn2.") for k in state)
    again = opforge.optimize(model, example_inputs=(x,))
    with torch.no_grad():
        for p in again.parameters():
            p.add_(1.0)
    again.load_state_dict(state)
    loaded = saved_and_loaded(fast)
    torch._dynamo.reset()
    compiled = torch.compile(fast, fullgraph=True)
    exported = torch.export.export(fast, (x,))
    with torch.no_grad():
        ref = model(x)
        tol = dict(atol=2e-4 * ref.abs().max().item(), rtol=2e-4)
        for other in (again, copy.deepcopy(fast), loaded, compiled, exported.module()):
            torch.testing.assert_close(other(x), ref, **tol)


def test_channels_last_and_dtype_moves_after_optimize():
    model = randomize_batchnorm(torchvision.models.resnet18(num_classes=10)).eval()
    model = model.to(memory_format=torch.channels_last)
    x = torch.randn(1, 3, 32, 32).to(memory_format=torch.channels_last)
    fast = opforge.optimize(model, example_inputs=(x,))
    for p in fast.parameters():
        if p.dim() == 4:
            assert p.is_contiguous(memory_format=torch.channels_last)
    as_double = copy.deepcopy(fast).to(torch.float64)
    with torch.no_grad():
        ref = model.to(torch.float64)(x.double())
        out = as_double(x.double())
    # The folded weights were rounded to float32 once, before the move: float32's tolerance.
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, ref, atol=1e-5 * ref.abs().max().item(), rtol=1e-5)


def test_training_mode_blocks_unshare_activations_and_keep_their_tails():
    """In training mode on the CPU no tail is fused (no ConvResidual: its BatchNorm would fold; no
    training tail: test_optimize_training_tails); the shared ReLU gets a copy per call, so that
    each block's conv1 -> bn1 -> relu is one conv2d_batch_norm with the ReLU in it."""
    model = torchvision.models.resnet18(num_classes=10).train()
    timed = opforge.optimize(model, example_inputs=(torch.randn(2, 3, 32, 32),))
    assert not any(isinstance(m, opforge.nn.ConvResidual) for m in timed.modules())
    fast, report = opforge.optimize(model, report=True)  # untimed: every chain is one op
    actions = {layer.conv: layer.action for layer in report.layers}
    for block in ("layer1.0", "layer2.1", "layer4.0"):
        assert actions[f"{block}.conv1"] == "conv + BatchNorm + ReLU as one op"
        assert actions[f"{block}.conv2"] == "conv + BatchNorm as one op"
    assert fast.training and fast.layer1[0].training
    assert list(fast.state_dict()) == list(model.state_dict())
    # The blocks call neither the BatchNorms' state holders nor the fused ReLUs' identities, and
    # the BatchNorm statistics still update as the original's do.
    identities = (torch.nn.Identity, opforge.nn_conv_batch_norm.BatchNormInConv)
    for block in (m for m in fast.modules() if isinstance(m, torch.fx.GraphModule)):
        called = [block.get_submodule(n.target) for n in block.graph.nodes if n.op == "call_module"]
        assert not any(isinstance(m, identities) for m in called), block.code
    # 64x64: at 32x32 layer4's BatchNorms normalize two values per channel, where any two
    # roundings (opforge's CPU batch norm engine against ATen's) move the output by up to 1e-3.
    x = torch.randn(2, 3, 64, 64)
    torch.testing.assert_close(fast(x), model(x), atol=1e-4, rtol=1e-4)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(fast.state_dict()[key], value, atol=1e-5, rtol=1e-5, msg=key)


class ModeReadingBlock(torch.nn.Module):
    """A block whose forward reads ``self.training``: a trace would fix one mode's code."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.bn = torch.nn.BatchNorm2d(4)
        self.relu = torch.nn.ReLU()

    def forward(self, x):
        y = self.relu(self.bn(self.conv(x)))
        y = self.relu(y + x)
        return y * 0.5 if self.training else y


def test_training_block_that_reads_its_mode_is_left():
    model = torch.nn.Sequential(ModeReadingBlock(), ModeReadingBlock()).train()
    x = torch.randn(2, 4, 8, 8)
    fast = opforge.optimize(model, example_inputs=(x,))
    assert all(type(b) is ModeReadingBlock for b in fast)
    # Left as it is, it still switches: the eval outputs are the original's.
    fast.eval()
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x))


class StochasticDepthBlock(ModeReadingBlock):
    """A block that drops its branch at random in training: a trace would fix one draw."""

    def forward(self, x):
        if self.training and random.random() < 0.5:
            return x
        return self.relu(self.relu(self.bn(self.conv(x))) + x)


def test_training_blocks_whose_code_a_trace_would_fix_are_left():
    model = torch.nn.Sequential(StochasticDepthBlock(), StochasticDepthBlock()).train()
    fast = opforge.optimize(model, example_inputs=(torch.randn(2, 4, 8, 8),))
    assert all(type(b) is StochasticDepthBlock for b in fast)
    # The blocks still draw on every call: some calls pass x through, some do not.
    x = torch.randn(2, 4, 8, 8)
    random.seed(0)
    with torch.no_grad():
        kept = [torch.equal(fast[0](x), x) for _ in range(40)]
    assert any(kept) and not all(kept)


def test_blocks_with_hooks_are_left_and_attributes_stay_readable():
    model = torchvision.models.resnet18(num_classes=10).train()
    calls = []
    model.layer4[1].register_forward_hook(lambda *args: calls.append(1))
    fast = opforge.optimize(model)  # untimed: every chain is one op, so the blocks stay rewritten
    assert type(fast.layer4[1]) is type(model.layer4[1])
    assert type(fast.layer4[0]) is not type(model.layer4[0])  # rewritten: its ReLU is split per call
    assert fast.layer2[0].stride == model.layer2[0].stride == 2
    before = len(calls)  # optimize's trace of the model calls it too
    fast(torch.randn(2, 3, 32, 32))
    assert len(calls) == before + 1


class FunctionalBlock(torch.nn.Module):
    """A block written with torch.add and F.relu, a shortcut through a 1x1 conv, and a conv without BatchNorm."""

    def __init__(self, act=None):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(4, 8, 3, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(8)
        self.conv2 = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.short = torch.nn.Conv2d(4, 8, 1)
        self.act = act

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        s = torch.add(self.conv2(y), self.short(x))
        return self.act(s) if self.act is not None else F.relu(s)


class Net(torch.nn.Module):
    def __init__(self, act=None):
        super().__init__()
        self.block = FunctionalBlock(act)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.block(x).mean((2, 3)))


@pytest.mark.parametrize("act", [None, torch.nn.SiLU(), torch.nn.Hardswish(), torch.nn.GELU()])
def test_functional_blocks_and_other_activations(act):
    model = randomize_batchnorm(Net(act)).eval()
    x = torch.randn(2, 4, 12, 12)
    fast, report = opforge.optimize(model, example_inputs=(x,), report=True)
    tails = [m for m in fast.modules() if isinstance(m, opforge.nn.ConvResidual)]
    if isinstance(act, torch.nn.GELU):  # not an activation opforge fuses: no tail, the GELU is called
        assert not tails, str(report)
        block = fast.block
        if isinstance(block, torch.fx.GraphModule):  # rewritten where a layer in it was replaced
            called = [block.get_submodule(n.target) for n in block.graph.nodes if n.op == "call_module"]
            assert any(isinstance(m, torch.nn.GELU) for m in called), block.code
        else:
            assert type(block) is FunctionalBlock
    else:
        assert len(tails) == 1, str(report)
        expected = {type(None): "relu", torch.nn.SiLU: "silu", torch.nn.Hardswish: "hardswish"}[type(act)]
        assert tails[0].activation == expected
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x), atol=1e-5, rtol=1e-5)


def test_shortcut_that_reads_the_branch_is_left():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(4, 4, 3, padding=1)
            self.relu = torch.nn.ReLU()

        def forward(self, x):
            y = self.conv(x)
            return self.relu(y + y * 2)

    model = torch.nn.Sequential(Block()).eval()
    x = torch.randn(1, 4, 8, 8)
    fast = opforge.optimize(model, example_inputs=(x,))
    assert not any(isinstance(m, opforge.nn.ConvResidual) for m in fast.modules())
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x))


def test_optimizing_an_optimized_model_again_keeps_it():
    model = randomize_batchnorm(torchvision.models.resnet18(num_classes=10)).eval()
    x = torch.randn(1, 3, 32, 32)
    once = opforge.optimize(model, example_inputs=(x,))
    twice = opforge.optimize(once, example_inputs=(x,))
    n_tails = sum(isinstance(m, opforge.nn.ConvResidual) for m in once.modules())
    assert sum(isinstance(m, opforge.nn.ConvResidual) for m in twice.modules()) == n_tails
    with torch.no_grad():
        ref = model(x)
        torch.testing.assert_close(twice(x), ref, atol=2e-4 * ref.abs().max().item(), rtol=2e-4)


def test_block_reading_its_own_tensors_keeps_them():
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(4, 4, 3, padding=1)
            self.bn = torch.nn.BatchNorm2d(4)
            self.gain = torch.nn.Parameter(torch.rand(1, 4, 1, 1) + 0.5)
            self.register_buffer("offset", torch.randn(1, 4, 1, 1))

        def forward(self, x):
            return F.relu(self.bn(self.conv(x)) + (x * self.gain + self.offset))

    model = torch.nn.Sequential(randomize_batchnorm(Scaled())).eval()
    x = torch.randn(2, 4, 8, 8)
    fast = opforge.optimize(model, example_inputs=(x,))
    assert isinstance(fast[0].conv, opforge.nn.ConvResidual)
    assert {"0.gain", "0.offset"} <= set(fast.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["mobilenet_v2", "mobilenet_v3_small"])
def test_eval_blocks_call_their_layers_without_containers_or_identities(name):
    """A block with no residual tail is still rewritten in eval mode: its graph calls the layers
    directly, not the Sequentials around them nor the identities folding and fusing left."""
    model = randomize_batchnorm(getattr(torchvision.models, name)(num_classes=10)).eval()
    x = torch.randn(2, 3, 64, 64)
    fast = opforge.optimize(model, force=True)
    blocks = [m for m in fast.modules() if isinstance(m, torch.fx.GraphModule)]
    assert len(blocks) == sum(type(m).__name__ == "InvertedResidual" for m in model.modules())
    for block in blocks:
        called = [block.get_submodule(n.target) for n in block.graph.nodes if n.op == "call_module"]
        assert not any(isinstance(m, (torch.nn.Identity, torch.nn.Sequential)) for m in called), block.code
    # Every module call costs host time: count them per forward.
    count = [0]

    def counter(module, args):
        count[0] += 1

    calls = []
    for m in (model, fast):
        count[0] = 0
        with torch.nn.modules.module.register_module_forward_pre_hook(counter), torch.no_grad():
            m(x)
        calls.append(count[0])
    assert calls[1] < calls[0] / 2, calls
    # Names and state are the original's, less the folded BatchNorms, plus their convs' new biases.
    batch_norms = [n for n, m in model.named_modules() if isinstance(m, torch.nn.BatchNorm2d)]
    dropped = set(model.state_dict()) - set(fast.state_dict())
    added = set(fast.state_dict()) - set(model.state_dict())
    assert dropped and all(any(k.startswith(bn + ".") for bn in batch_norms) for k in dropped)
    assert all(k.endswith(".bias") and k[: -len("bias")] + "weight" in model.state_dict() for k in added)
    loaded = saved_and_loaded(fast)
    with torch.no_grad():
        ref = model(x)
        tol = dict(atol=2e-4 * ref.abs().max().item(), rtol=2e-4)
        for other in (fast, copy.deepcopy(fast), loaded):
            torch.testing.assert_close(other(x), ref, **tol)


def test_eval_block_that_keeps_state_between_calls_is_left():
    class Counting(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(4, 4, 3, padding=1)
            self.bn = torch.nn.BatchNorm2d(4)
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return torch.relu(self.bn(self.conv(x)))

    model = torch.nn.Sequential(randomize_batchnorm(Counting())).eval()
    x = torch.randn(1, 4, 8, 8)
    fast = opforge.optimize(model, force=True)
    assert type(fast[0]) is Counting
    before = fast[0].calls
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x), atol=1e-5, rtol=1e-5)
        fast(x)
    assert fast[0].calls == before + 2
