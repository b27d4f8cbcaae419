"""optimize in training mode: a chain's conv alone as opforge's layer, or the chain as one op, where it times faster.

Which layers win is a timing, so here the timings are fixed (monkeypatched): the path
under test then always runs, whatever the machine's load. Nothing is folded."""

import copy
import importlib

import pytest
import torch
from training_models import step, train_model

import opforge

optimize_module = importlib.import_module("opforge.optimize")
train_chain_module = importlib.import_module("opforge.optimize_train_chain")


@pytest.fixture
def opforge_always_wins(monkeypatch):
    """opforge's conv alone wins every timing: against torch's conv, and on the CPU, against the
    chain as one op and the modules."""

    def win(*args, **kwargs):
        return True, "measured 1.0 us vs 2.0 us for torch's layers", 1.0

    def conv_alone_fastest(candidate, act, x, options, extra=()):
        return {name: 1.0 if name.endswith(" alone") else 2.0 for name in options}

    monkeypatch.setattr(optimize_module, "faster_with_opforge", win)
    monkeypatch.setattr(train_chain_module, "faster_with_opforge", win)
    monkeypatch.setattr(train_chain_module, "training_times_us", conv_alone_fastest)


def fixed_chain_times(monkeypatch, **times_us):
    """The CPU's training-chain timings fixed (us): torch, op (the chain as one op), alone (opforge's
    conv alone), conv_op (opforge's conv, then the batch norm op); returns the timed options."""
    seen = []

    def kind(name):
        if name.endswith(" alone"):
            return "alone"
        if name.endswith(" + batch norm op"):
            return "conv_op"
        return {"torch's layers": "torch", "one op": "op"}[name]

    def times(candidate, act, x, options, extra=()):
        seen.append(dict(options))
        return {name: times_us[kind(name)] for name in options}

    monkeypatch.setattr(train_chain_module, "training_times_us", times)
    return seen


def opforge_convs(model):
    return [m for m in model.modules() if isinstance(m, (opforge.nn.Conv2d3x3, opforge.nn.Conv2d1x1))]


def test_convs_alone_keep_the_parameters_and_train_alike(opforge_always_wins, device):
    # NCHW: on CUDA too, the batch norm engine does not take these chains.
    model = train_model("mobilenet_v2", device)
    x = torch.randn(2, 3, 64, 64, device=device)
    reference64 = copy.deepcopy(model).double()
    params = dict(model.named_parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # built before optimize, as a training script's is
    fast, report = opforge.optimize(model, example_inputs=(x,), inplace=True, report=True)
    assert fast is model
    chains = [r for r in report.layers if "BatchNorm2d" in r.pattern]
    # Every conv of mobilenet_v2 (3x3 dense and depthwise, 1x1) has an opforge kernel.
    assert chains and all(r.action.endswith("kept)") for r in chains)
    assert len(opforge_convs(fast)) == len(chains)
    assert all(type(m) is torch.nn.BatchNorm2d for m in fast.modules() if "BatchNorm" in type(m).__name__)
    assert not any(isinstance(m, torch.nn.Conv2d) for m in fast.modules())
    # The layers hold the model's own parameters: the optimizer built before steps them.
    assert {name: p for name, p in fast.named_parameters()}.keys() == params.keys()
    assert all(p is params[name] for name, p in fast.named_parameters())
    # Against the original in float64 (opforge's convs sum in their own order): to rounding.
    fast64 = copy.deepcopy(fast).double()
    for _ in range(2):
        torch.testing.assert_close(step(fast64, x.double()), step(reference64, x.double()), rtol=1e-10, atol=1e-10)
    for (k, a), b in zip(fast64.state_dict().items(), reference64.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=lambda m, k=k: f"{k}: {m}")
    conv = opforge_convs(fast)[1]
    before = conv.weight.detach().clone()
    fast(x).square().mean().backward()
    opt.step()
    assert not torch.equal(conv.weight.detach(), before)


def test_conv_with_hooks_is_left(opforge_always_wins):
    model = train_model("mobilenet_v2")
    hooked = model.features[1].conv[0][0]
    calls = []
    hooked.register_forward_hook(lambda module, args, out: calls.append(out.shape))
    x = torch.randn(2, 3, 64, 64)
    fast, report = opforge.optimize(model, example_inputs=(x,), report=True)
    row = next(r for r in report.layers if r.conv == "features.1.conv.0.0")
    assert row.action == "left" and "hooks" in row.reason, row
    assert type(fast.get_submodule("features.1.conv.0.0")) is torch.nn.Conv2d
    assert len(opforge_convs(fast)) == sum("BatchNorm2d" in r.pattern for r in report.layers) - 1
    calls.clear()
    step(fast, x)
    assert len(calls) == 1  # the hook still runs


@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_eval_mode_is_unchanged_by_the_training_choice(opforge_always_wins, layout):
    """The conv-alone choice is for training chains only: in eval mode the BatchNorm is folded."""
    model = train_model("mobilenet_v2").eval()
    x = torch.randn(2, 3, 64, 64)
    if layout == "channels_last":
        model, x = model.to(memory_format=torch.channels_last), x.to(memory_format=torch.channels_last)
    fast, report = opforge.optimize(model, example_inputs=(x,), report=True)
    assert not any(r.action.endswith("kept)") for r in report.layers)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x), rtol=1e-4, atol=1e-5)


def assert_step_as_close_to_float64(fast, reference, reference64, x):
    """One step of each: the first loss to float32's rounding, and every tensor of fast's state after
    the step no farther from float64's than 4x the float32 modules' own distance (a BatchNorm over
    few values per channel makes the step ill-conditioned in float32 either way)."""
    losses = step(fast, x), step(reference, x), step(reference64, x.double())
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-7)
    exact = reference64.state_dict()
    for (key, ours), theirs in zip(fast.state_dict().items(), reference.state_dict().values()):
        our_error = (ours.double() - exact[key]).abs().max()
        their_error = (theirs.double() - exact[key]).abs().max()
        assert our_error <= 4 * their_error + 1e-6, (key, our_error, their_error)


def test_cpu_chain_as_one_op_where_it_times_fastest(monkeypatch):
    seen = fixed_chain_times(monkeypatch, torch=3.0, op=2.0, alone=2.5, conv_op=2.2)
    model = train_model("mobilenet_v2")
    x = torch.randn(2, 3, 64, 64)
    reference, reference64 = copy.deepcopy(model), copy.deepcopy(model).double()
    fast, report = opforge.optimize(model, example_inputs=(x,), report=True)
    chains = [r for r in report.layers if "BatchNorm2d" in r.pattern]
    assert chains and all(r.action.endswith("as one op") for r in chains), chains[0]
    assert all("one op 2.0 us" in r.reason and "torch's layers 3.0 us" in r.reason for r in chains)
    assert len([m for m in fast.modules() if isinstance(m, opforge.nn.ConvBatchNorm2d)]) == len(chains)
    # Each chain timed four ways (every conv of mobilenet_v2 has an opforge kernel).
    assert seen and all(len(options) == 4 for options in seen)
    assert_step_as_close_to_float64(fast, reference, reference64, x)


def test_cpu_chain_as_opforge_conv_then_batch_norm_op(monkeypatch):
    fixed_chain_times(monkeypatch, torch=3.0, op=2.0, alone=2.5, conv_op=1.5)
    model = train_model("mobilenet_v3_large")
    x = torch.randn(2, 3, 64, 64)
    reference, reference64 = copy.deepcopy(model), copy.deepcopy(model).double()
    params = dict(model.named_parameters())
    fast, report = opforge.optimize(model, example_inputs=(x,), report=True, inplace=True)
    # Its 5x5 depthwise convs have no opforge kernel: those chains are the conv2d_batch_norm op.
    chains = [r for r in report.layers if "BatchNorm2d" in r.pattern and "5x5" not in r.pattern]
    assert chains and all(r.action.endswith("as one op") and ", BatchNorm" in r.action for r in chains)
    assert all(r.action.startswith("conv + BatchNorm") for r in report.layers if "5x5" in r.pattern)
    fused = [m for m in fast.modules() if isinstance(m, opforge.nn.BatchNormAct2d)]
    assert len(fused) == len(chains)
    assert all(type(fast.get_submodule(r.conv)) in (opforge.nn.Conv2d3x3, opforge.nn.Conv2d1x1) for r in chains)
    assert {m.activation for m in fused} == {None, "relu", "hardswish"}
    # The model's own parameters under their names, and the state_dict's keys.
    assert all(p is params[name] for name, p in fast.named_parameters())
    assert list(fast.state_dict()) == list(reference.state_dict())
    assert_step_as_close_to_float64(fast, reference, reference64, x)


def test_cpu_chain_left_when_no_option_wins_by_the_margin(monkeypatch):
    fixed_chain_times(monkeypatch, torch=2.0, op=1.99, alone=1.98, conv_op=1.97)
    model = train_model("mobilenet_v2")
    x = torch.randn(2, 3, 64, 64)
    fast, report = opforge.optimize(model, example_inputs=(x,), report=True)
    chains = [r for r in report.layers if "BatchNorm2d" in r.pattern]
    assert chains and all(r.action == "left" for r in chains)
    assert not opforge_convs(fast) and not any(isinstance(m, opforge.nn.ConvBatchNorm2d) for m in fast.modules())


def test_cpu_chain_timing_leaves_the_model_as_it_was():
    """The three real timings run the model's conv and a copy of its BatchNorm: no statistic moves,
    no gradient is left on a parameter."""
    model = train_model("mobilenet_v2")
    x = torch.randn(2, 3, 64, 64)
    before = copy.deepcopy(model.state_dict())
    opforge.optimize(model, example_inputs=(x,), report=True, inplace=False)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert all(p.grad is None for p in model.parameters())
