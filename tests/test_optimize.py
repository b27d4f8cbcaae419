"""opforge.optimize: BatchNorm folding, fused 3x3 convs chosen by timing, and the report."""

import copy
import sys
import time

import pytest
import torch
from reference import randomize_batchnorm

import opforge
from opforge.optimize_fold import folded_weight_and_bias

torchvision = pytest.importorskip("torchvision")


def test_fold_math_is_exact_in_float64():
    conv = torch.nn.Conv2d(5, 7, 3, padding=1, dtype=torch.float64)
    bn = randomize_batchnorm(torch.nn.BatchNorm2d(7, dtype=torch.float64)).eval()
    x = torch.randn(2, 5, 9, 9, dtype=torch.float64)
    w, b = folded_weight_and_bias(conv.weight, conv.bias, bn)
    expected = bn(conv(x))
    got = torch.nn.functional.conv2d(x, w, b, padding=1)
    torch.testing.assert_close(got, expected, atol=1e-10, rtol=1e-10)


MODELS = ["mobilenet_v2", "mobilenet_v3_large", "mobilenet_v3_small", "resnet18", "resnet50"]


@pytest.mark.parametrize("name", MODELS)
def test_eval_model_keeps_its_outputs(name):
    model = randomize_batchnorm(getattr(torchvision.models, name)(num_classes=10)).eval()
    x = torch.randn(2, 3, 64, 64)
    fast, report = opforge.optimize(model, example_inputs=(x,), report=True)
    assert type(fast) is type(model) and fast is not model
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x), atol=2e-4, rtol=2e-4)
    folded = [r for r in report.layers if "BatchNorm folded" in r.action]
    assert folded, str(report)
    n_bn = sum(isinstance(m, torch.nn.BatchNorm2d) for m in fast.modules())
    assert n_bn == sum(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules()) - len(folded)


# The activation each model's 3x3 blocks end with, fused when forced.
FUSED = {
    "mobilenet_v2": "relu6",
    "mobilenet_v3_large": "hardswish",
    "mobilenet_v3_small": "hardswish",
    "resnet18": "relu",  # each block's first conv, once its shared ReLU is split
}


@pytest.mark.parametrize("name", list(FUSED))
def test_forced_replacement_keeps_outputs(name):
    """Every 3x3 and 1x1 conv opforge has a kernel for runs opforge's fused kernel: same outputs."""
    model = randomize_batchnorm(getattr(torchvision.models, name)(num_classes=10)).eval()
    x = torch.randn(2, 3, 64, 64)
    fast, report = opforge.optimize(model, report=True, force=True)
    # A residual block's last conv is part of its fused tail (test_optimize_residual.py).
    ours = [m for m in fast.modules() if isinstance(m, opforge.nn.Conv2d3x3)]
    tails = [m for m in fast.modules() if isinstance(m, opforge.nn.ConvResidual) and m.kernel_size == (3, 3)]
    n3x3 = sum(isinstance(m, torch.nn.Conv2d) and m.kernel_size == (3, 3) for m in model.modules())
    assert len(ours) + len(tails) == n3x3, str(report)
    pointwise = [m for m in fast.modules() if isinstance(m, opforge.nn.Conv2d1x1)]
    n1x1 = sum(isinstance(m, torch.nn.Conv2d) and m.kernel_size == (1, 1) and m.groups == 1 for m in model.modules())
    # A squeeze-excitation block's two 1x1 convs run inside its one op call.
    squeezes = sum(isinstance(m, opforge.nn.SqueezeExcitation) for m in fast.modules())
    assert len(pointwise) + 2 * squeezes == n1x1 and pointwise, str(report)
    if FUSED[name]:
        assert any(m.activation == FUSED[name] for m in ours), str(report)
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in fast.modules())
    with torch.no_grad():
        ref = model(x)
        torch.testing.assert_close(fast(x), ref, atol=2e-4 * ref.abs().max().item(), rtol=2e-4)


def assert_same_gradients(model, fast, x):
    """One backward of the same loss through both models gives the same parameter gradients."""
    for m in (model, fast):
        torch.optim.SGD(m.parameters(), lr=0.1).zero_grad()
        m(x).square().mean().backward()
    for p, q in zip(model.parameters(), fast.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("act", [torch.nn.ReLU, torch.nn.ReLU6, torch.nn.Hardswish, torch.nn.SiLU])
def test_training_fuses_activation_and_trains_the_same(act):
    """In training mode conv + activation (no BatchNorm between) fuse, forward and backward."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), act(), torch.nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=8), act()
    ).train()
    fast, report = opforge.optimize(model, report=True, force=True)
    assert [type(m) for m in fast] == [opforge.nn.Conv2d3x3, torch.nn.Identity] * 2, str(report)
    assert all(f"{act.__name__} fused" in r.action for r in report.layers), str(report)
    assert_same_gradients(model, fast, torch.randn(2, 3, 16, 16))


@pytest.mark.parametrize("act", [torch.nn.ReLU6, torch.nn.SiLU])
def test_pointwise_convs_fuse_and_train_the_same(act):
    """1x1 convs (groups 1, no padding) fuse their activation too, in training mode as in eval."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 1), act(), torch.nn.Conv2d(8, 16, 1, stride=2), act()).train()
    fast, report = opforge.optimize(model, report=True, force=True)
    assert [type(m) for m in fast] == [opforge.nn.Conv2d1x1, torch.nn.Identity] * 2, str(report)
    assert all("opforge conv2d_1x1" in r.action for r in report.layers), str(report)
    assert_same_gradients(model, fast, torch.randn(2, 3, 16, 16))


def test_optimized_model_exports():
    model = randomize_batchnorm(torchvision.models.mobilenet_v3_small(num_classes=10)).eval()
    fast = opforge.optimize(model, force=True)
    x = torch.randn(2, 3, 64, 64)
    ep = torch.export.export(fast, (x,))
    ops = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert any("opforge.conv2d_3x3" in o for o in ops), ops
    assert any("opforge.conv2d_1x1" in o for o in ops), ops
    with torch.no_grad():
        torch.testing.assert_close(ep.module()(x), fast(x))


def test_without_example_inputs_no_conv_is_swapped():
    model = randomize_batchnorm(torchvision.models.mobilenet_v2(num_classes=10)).eval()
    fast, report = opforge.optimize(model, report=True)
    assert not any(isinstance(m, opforge.nn.Conv2d3x3) for m in fast.modules())
    assert any("pass example_inputs" in r.reason for r in report.layers)
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x), atol=2e-4, rtol=2e-4)


def test_training_mode_folds_nothing_and_trains_the_same():
    torch.manual_seed(0)
    model = randomize_batchnorm(torchvision.models.mobilenet_v2(num_classes=4)).train()
    # Large enough planes and batch that the last BatchNorms' batch statistics are not ill-conditioned
    # (at 2x3x32x32 they average 2 values, and float32's loss moves by 5e-4 between summation orders).
    x = torch.randn(4, 3, 64, 64)
    in_float64 = copy.deepcopy(model).double()
    fast, report = opforge.optimize(model, example_inputs=(x,), report=True)
    assert sum(isinstance(m, torch.nn.BatchNorm2d) for m in fast.modules()) == sum(
        isinstance(m, torch.nn.BatchNorm2d) for m in model.modules()
    )
    assert all("BatchNorm folded" not in r.action for r in report.layers)
    losses = []
    for m, inputs in ((in_float64, x.double()), (model, x), (fast, x)):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        torch.manual_seed(1)  # the same dropout mask for each
        loss = m(inputs).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)  # torch's float32 step
    assert losses[2] == pytest.approx(losses[0], rel=1e-5)  # the optimized model's (may run channels_last)


def traced_ops(model, x):
    """The functions and methods in the graphs torch.compile's tracer makes of one call of ``model``,
    counted; relu6 is counted as the hardtanh it is, an in-place add as an add (a rewritten block's
    trace records ``out += identity`` as one; functionalization makes them the same op)."""
    import collections

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend, fullgraph=True)(x)
    torch._dynamo.reset()
    names = {"relu6": "hardtanh", "iadd": "add"}
    ops = collections.Counter()
    for gm in graphs:
        for node in gm.graph.nodes:
            if node.op in ("call_function", "call_method"):
                name = getattr(node.target, "__name__", str(node.target))
                ops[names.get(name, name)] += 1
    return len(graphs), ops


@pytest.mark.parametrize("name", ["mobilenet_v2", "resnet18"])
def test_compiled_training_model_traces_as_the_original(name):
    # In training mode the fused conv + BatchNorm layers and rewritten blocks leave torch.compile the
    # original's ops, so that inductor fuses them as it would the original's.
    torch.manual_seed(0)
    model = randomize_batchnorm(getattr(torchvision.models, name)(num_classes=4)).train()
    x = torch.randn(2, 3, 32, 32)
    fast, report = opforge.optimize(model, report=True)  # untimed: every chain is one op
    assert any("as one op" in r.action for r in report.layers)
    assert traced_ops(fast, x) == traced_ops(model, x)


def test_layers_opforge_has_no_kernel_for_are_left_alone():
    convs = [
        torch.nn.Conv2d(8, 8, 3, padding=2, dilation=2),
        torch.nn.Conv2d(8, 8, 5, padding=2),
        torch.nn.Conv2d(8, 8, 3, padding=1, groups=2),
        torch.nn.Conv2d(8, 8, 3, padding=1, padding_mode="reflect"),
        torch.nn.Conv2d(8, 8, 1, groups=2),
        torch.nn.Conv2d(8, 8, 1, padding=1),
        torch.nn.Conv2d(8, 8, 1, stride=(1, 2)),
    ]
    model = torch.nn.Sequential(*convs).eval()
    x = torch.randn(1, 8, 12, 12)
    fast, report = opforge.optimize(model, example_inputs=(x,), report=True)
    # Never opforge's own kernels; on the CPU oneDNN's engine with a prepacked weight may run one
    # where it timed faster (it needs zero padding).
    assert all(type(m) in (torch.nn.Conv2d, opforge.nn.PrepackedConv2d) for m in fast), fast
    assert type(fast[3]) is torch.nn.Conv2d
    assert all(r.reason.startswith("opforge has no kernel for this conv") for r in report.layers), str(report)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("traced", [True, False])
def test_batch_norm_without_running_statistics_is_kept(training, traced):
    """It normalizes with the batch's statistics in eval mode too: not folded, not fused; the conv
    before it is still a candidate of its own."""

    class Untraced(torch.nn.Sequential):
        def forward(self, x):
            return super().forward(x) if x.sum() != 0 else x  # fx: a Proxy cannot be a bool

    kind = torch.nn.Sequential if traced else Untraced
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm2d(8, track_running_stats=False)
    bn.weight.data.uniform_(0.5, 1.5)
    bn.bias.data.uniform_(-0.5, 0.5)
    model = kind(torch.nn.Conv2d(3, 8, 3, padding=1), bn, torch.nn.ReLU()).train(training)
    fast, report = opforge.optimize(model, report=True, force=True)
    assert type(fast[1]) is torch.nn.BatchNorm2d and fast[1].running_mean is None and type(fast[2]) is torch.nn.ReLU
    (row,) = report.layers
    assert row.pattern == "Conv2d(3x3, dense, s1)" and row.action != "left", str(report)
    x = torch.randn(2, 3, 10, 10)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x), atol=1e-5, rtol=1e-5)


class _ConvSamePadding(torch.nn.Conv2d):
    """Pads by the input's size, as TensorFlow's "SAME": what its layer computes is its own."""

    def forward(self, x):
        pad = [max((-(n // -s) - 1) * s + self.kernel_size[0] - n, 0) for n, s in zip(x.shape[-2:], self.stride)]
        x = torch.nn.functional.pad(x, [pad[1] // 2, pad[1] - pad[1] // 2, pad[0] // 2, pad[0] - pad[0] // 2])
        return torch.nn.functional.conv2d(x, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)


class _BatchNormThenReLU(torch.nn.BatchNorm2d):
    def forward(self, x):
        return torch.relu(super().forward(x))


@pytest.mark.parametrize("force", [True, False])
def test_subclasses_with_a_forward_of_their_own_are_not_taken_for_torchs(force):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        _ConvSamePadding(4, 8, 3, stride=2),
        torch.nn.BatchNorm2d(8),
        torch.nn.Conv2d(8, 8, 3, padding=1),
        _BatchNormThenReLU(8),
        torch.nn.Conv2d(8, 8, 3, padding=1),
        torch.nn.BatchNorm2d(8),
    )
    model = randomize_batchnorm(model).eval()
    x = torch.randn(2, 4, 9, 9)
    kwargs = {"force": True} if force else {"example_inputs": (x,)}
    fast, report = opforge.optimize(model, report=True, **kwargs)
    rows = {row.conv: row for row in report.layers}
    assert rows["0"].action == "left" and "_ConvSamePadding overrides Conv2d's forward" in rows["0"].reason
    assert type(fast[0]) is _ConvSamePadding and type(fast[1]) is torch.nn.BatchNorm2d
    assert rows["2"].pattern == "Conv2d(3x3, dense, s1)"  # the BatchNorm with an activation is no link
    assert type(fast[3]) is _BatchNormThenReLU
    assert rows["4"].action.startswith("BatchNorm folded") and type(fast[5]) is torch.nn.Identity
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x), atol=1e-5, rtol=1e-5)


def test_a_weight_normed_conv_is_folded_through_its_parametrization():
    torch.manual_seed(0)
    conv = torch.nn.utils.parametrizations.weight_norm(torch.nn.Conv2d(4, 8, 3, padding=1))
    model = randomize_batchnorm(torch.nn.Sequential(conv, torch.nn.BatchNorm2d(8), torch.nn.ReLU())).eval()
    fast, report = opforge.optimize(model, report=True, force=True)
    assert report.layers[0].action.startswith("BatchNorm folded"), str(report)
    x = torch.randn(2, 4, 9, 9)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x), atol=1e-5, rtol=1e-5)


def test_shared_activation_is_not_fused():
    class Block(torch.nn.Module):  # one ReLU module used twice, as in torchvision's ResNet
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(4, 4, 3, padding=1)
            self.relu = torch.nn.ReLU()

        def forward(self, x):
            return self.relu(self.relu(self.conv(x)) + x)

    model = Block().eval()
    x = torch.randn(1, 4, 8, 8)
    fast, report = opforge.optimize(model, example_inputs=(x,), report=True)
    assert isinstance(fast.relu, torch.nn.ReLU)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x))


def test_state_dict_round_trip_and_compile():
    model = randomize_batchnorm(torchvision.models.mobilenet_v2(num_classes=10)).eval()
    x = torch.randn(1, 3, 32, 32)
    fast = opforge.optimize(model, example_inputs=(x,))
    again = opforge.optimize(model, example_inputs=(x,))
    again.load_state_dict(fast.state_dict())
    torch._dynamo.reset()
    compiled = torch.compile(fast, fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(again(x), fast(x))
        torch.testing.assert_close(compiled(x), model(x), atol=2e-4, rtol=2e-4)


def test_channels_last_parameters_keep_their_format():
    model = torch.nn.Sequential(torch.nn.Conv2d(16, 16, 3, padding=1, groups=16), torch.nn.ReLU()).eval()
    model = model.to(memory_format=torch.channels_last)
    x = torch.randn(1, 16, 20, 20).to(memory_format=torch.channels_last)
    fast = opforge.optimize(model, example_inputs=(x,))
    for p in fast.parameters():
        if p.dim() == 4:
            assert p.is_contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x))


def test_bad_model_argument():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        opforge.optimize(lambda x: x)
    scripted = torch.jit.script(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4)).eval())
    with pytest.raises(TypeError, match="model is a TorchScript module"):
        opforge.optimize(scripted)


def test_example_inputs_given_bare_or_as_a_list_mean_one_batch():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU()).eval()
    randomize_batchnorm(model)
    x = torch.randn(2, 3, 10, 10)
    for given in (x, [x]):
        _, report = opforge.optimize(model, example_inputs=given, report=True)
        assert [("measured" in layer.reason) for layer in report.layers] == [True]
    with pytest.raises(TypeError, match="example_inputs must be a tuple of the model's positional inputs"):
        opforge.optimize(model, example_inputs=5)


@pytest.fixture
def layout_kept(monkeypatch):
    """No model-level layout choice: the tests that count the layer timings optimize each layer
    once (an NCHW model that a real timing kept NCHW would be optimized in both layouts)."""
    monkeypatch.setattr(sys.modules["opforge.optimize"], "choose_channels_last", lambda model, inputs: (False, ""))


def test_folding_is_kept_only_where_it_does_not_time_slower(monkeypatch, layout_kept):
    """The fold is a measured choice too: where the folded conv times slower, the pair stays,
    unless opforge's kernel on the folded conv beats the pair."""
    from opforge import optimize_choice

    model = torch.nn.Sequential(torch.nn.Conv2d(4, 4, 1), randomize_batchnorm(torch.nn.BatchNorm2d(4))).eval()
    x = torch.randn(1, 4, 8, 8)

    # opforge's kernel alone against torch's layers (the prepacked CPU engine has its own test)
    monkeypatch.setattr(optimize_choice.PrepackedCandidate, "of", classmethod(lambda cls, *args: None))

    def optimize_with_times(times):
        calls = iter(times)
        monkeypatch.setattr(optimize_choice, "_cache", {})
        monkeypatch.setattr(optimize_choice, "_median_us", lambda fn, device: (fn(), next(calls))[1])
        fast, report = opforge.optimize(model, example_inputs=(x,), report=True)
        assert next(calls, None) is None  # every timing asked for was used
        return fast, str(report.layers[0].action), report.layers[0].reason

    # conv + BatchNorm, the folded conv (slower), then torch's pair vs opforge's kernel (a tie keeps the pair)
    fast, action, reason = optimize_with_times([10.0, 20.0, 10.0, 10.0])
    assert isinstance(fast[0], torch.nn.Conv2d) and isinstance(fast[1], torch.nn.BatchNorm2d)
    assert action == "left" and reason.startswith("BatchNorm not folded: folded 20.0 us vs 10.0 us"), reason
    assert "measured 10.0 us vs 10.0 us" in reason
    # the fold is slower alone, but opforge's kernel on the folded conv beats the pair, and then
    # also the conv alone that torch.compile would run
    fast, action, reason = optimize_with_times([10.0, 20.0, 10.0, 5.0, 6.0, 5.0])
    assert isinstance(fast[0], opforge.nn.Conv2d1x1) and isinstance(fast[1], torch.nn.Identity)
    assert action == "BatchNorm folded, opforge conv2d_1x1", action
    assert not fast[0].torch_when_compiled
    assert "measured 5.0 us vs 6.0 us for the conv and the one pass torch.compile runs" in reason, reason
    # the fold pays; opforge's kernel ties with the folded conv: the folded conv stays
    fast, action, reason = optimize_with_times([20.0, 10.0, 10.0, 10.0])
    assert isinstance(fast[0], torch.nn.Conv2d) and isinstance(fast[1], torch.nn.Identity)
    assert action == "BatchNorm folded" and "measured 10.0 us vs 10.0 us" in reason
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", [1, 3])
def test_layer_slower_than_inductors_form_traces_as_torch_ops(monkeypatch, kernel, layout_kept):
    """A layer whose kernel beats torch's eager layers but not the conv alone (what inductor runs,
    the bias and activation fused elsewhere) runs opforge's op in eager and torch's under compile."""
    from opforge import optimize_choice

    model = torch.nn.Sequential(torch.nn.Conv2d(8, 8, kernel, padding=kernel // 2), torch.nn.ReLU()).eval()
    op, module = ("conv2d_1x1", opforge.nn.Conv2d1x1) if kernel == 1 else ("conv2d_3x3", opforge.nn.Conv2d3x3)
    x = torch.randn(2, 8, 10, 10)
    # eager: torch's layers 10 us, opforge 5 us; compiled: torch's conv + pass 4 us, opforge 5 us
    calls = iter([10.0, 5.0, 4.0, 5.0])
    monkeypatch.setattr(optimize_choice.PrepackedCandidate, "of", classmethod(lambda cls, *args: None))
    monkeypatch.setattr(optimize_choice, "_cache", {})
    monkeypatch.setattr(optimize_choice, "_median_us", lambda fn, device: (fn(), next(calls))[1])
    fast, report = opforge.optimize(model, example_inputs=(x,), report=True)
    assert next(calls, None) is None
    layer = fast[0]
    assert isinstance(layer, module) and layer.activation == "relu" and layer.torch_when_compiled
    assert report.layers[0].action == f"opforge {op} + ReLU fused; torch's conv under torch.compile"
    assert "torch_when_compiled=True" in repr(layer)

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(fast, backend=capture, fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(fast(x), model(x), atol=1e-5, rtol=1e-5)
    traced = " ".join(str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function")
    assert "conv2d" in traced and "opforge" not in traced, traced
    # a layer that wins under compile too is traced as opforge's op
    layer.torch_when_compiled = False
    graphs.clear()
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(fast, backend=capture, fullgraph=True)(x)
    traced = " ".join(str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function")
    assert f"opforge.{op}" in traced, traced


@pytest.mark.parametrize("prepacked_us, expected", [(3.0, "prepacked"), (6.0, "opforge"), (20.0, "opforge")])
def test_fastest_winning_candidate_is_taken(monkeypatch, prepacked_us, expected, layout_kept):
    """On the CPU a layer has two candidates, opforge's kernel and oneDNN with a prepacked weight;
    of those faster than torch's layers, the fastest replaces them."""
    from opforge import optimize_choice

    if optimize_choice.PrepackedCandidate.of(torch.nn.Conv2d(4, 4, 1).eval(), None, torch.randn(1, 4, 4, 4)) is None:
        pytest.skip("oneDNN does not run float32 convolutions in this build")
    model = torch.nn.Sequential(torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.ReLU6()).eval()
    x = torch.randn(1, 8, 10, 10)
    # torch's layers, opforge's kernel, the prepacked conv; then, if opforge's kernel is taken, the
    # compiled comparison (torch's conv + pass, opforge's kernel)
    times = [10.0, 5.0, prepacked_us] + ([1.0, 5.0] if expected == "opforge" else [])
    calls = iter(times)
    monkeypatch.setattr(optimize_choice, "_cache", {})
    monkeypatch.setattr(optimize_choice, "_median_us", lambda fn, device: (fn(), next(calls))[1])
    fast, report = opforge.optimize(model, example_inputs=(x,), report=True)
    assert next(calls, None) is None
    kind = opforge.nn.PrepackedConv2d if expected == "prepacked" else opforge.nn.Conv2d3x3
    assert type(fast[0]) is kind and fast[0].activation == "relu6" and isinstance(fast[1], torch.nn.Identity)
    label = "oneDNN conv with a prepacked weight" if expected == "prepacked" else "opforge conv2d_3x3"
    assert report.layers[0].action.startswith(f"{label} + ReLU6 fused"), report.layers[0].action
    assert f"oneDNN conv with a prepacked weight: measured {prepacked_us:.1f} us vs 10.0 us" in report.layers[0].reason
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x), atol=1e-5, rtol=1e-5)


def test_compiled_nchw_model_hands_its_own_layout_to_the_fused_convs():
    """The fused convs take any strides (the flexible_layout tag), so inductor may pass the
    layout it keeps for conv outputs instead of copying back to the eager strides; the
    results are the eager model's."""
    for op in (
        torch.ops.opforge.conv2d_3x3.default,
        torch.ops.opforge.conv2d_3x3.padding,
        torch.ops.opforge.conv2d_1x1.default,
    ):
        assert torch.Tag.flexible_layout in op.tags, op
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, stride=2, padding=1),
        torch.nn.ReLU6(),
        torch.nn.Conv2d(16, 16, 3, padding=1, groups=16),
        torch.nn.ReLU6(),
        torch.nn.Conv2d(16, 24, 1),
    ).eval()
    x = torch.randn(2, 3, 32, 32)
    fast = opforge.optimize(model, force=True)
    assert isinstance(fast[2], opforge.nn.Conv2d3x3) and isinstance(fast[4], opforge.nn.Conv2d1x1)
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(fast, fullgraph=True)(x)
        torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)


def test_layer_timing_takes_fewer_calls_per_sample_for_a_slow_layer():
    from opforge import optimize_choice

    def counted(seconds):
        calls = []

        def fn():
            calls.append(None)
            if seconds:
                time.sleep(seconds)

        return fn, calls

    cpu = torch.device("cpu")
    fast, fast_calls = counted(0)
    optimize_choice._median_us(fast, cpu, calls=20, repeats=3)
    assert len(fast_calls) == 1 + 1 + 3 * 20  # untimed, probe, then full samples
    fixed, fixed_calls = counted(0.004)
    optimize_choice._median_us(fixed, cpu, calls=20, repeats=3, sample_s=None)
    assert len(fixed_calls) == 1 + 3 * 20
    slow, slow_calls = counted(0.004)
    us = optimize_choice._median_us(slow, cpu, calls=20, repeats=3, sample_s=0.005)
    assert len(slow_calls) <= 1 + 1 + 3 * 2  # a 4 ms call: at most two per 5 ms sample
    assert us >= 4000
