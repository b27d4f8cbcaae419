"""optimize's last check: the whole model timed as optimized and as it was, put back where it is
not faster. The verdicts here are fixed (``_timed`` monkeypatched) except where a test says it
times for real; the layers' own timings are made wins, so that something is replaced."""

import copy
import importlib

import pytest
import torch
from training_models import train_model

import opforge
from opforge import optimize_guard, optimize_layout

optimize_module = importlib.import_module("opforge.optimize")


@pytest.fixture
def layers_win(monkeypatch):
    for module in (optimize_module, importlib.import_module("opforge.optimize_train_chain")):
        monkeypatch.setattr(module, "faster_with_opforge", lambda *a, **k: (True, "measured 1.0 us vs 2.0 us", 1.0))
    monkeypatch.setattr(optimize_module, "faster_under_compile", lambda *a, **k: (True, "GPU time"))
    monkeypatch.setattr(optimize_module, "folding_pays", lambda *a, **k: (True, ""))
    monkeypatch.setattr(optimize_module, "choose_channels_last", lambda model, inputs: (False, ""))


def whole_model_times(monkeypatch, before_us, after_us):
    calls = []

    def timed(before, after, example_inputs, device):
        calls.append(before.model)
        return before_us, after_us

    monkeypatch.setattr(optimize_guard, "_timed", timed)
    return calls


def block(training=False):
    model = torch.nn.Sequential(
        torch.nn.Conv2d(4, 8, 3, padding=1),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.Conv2d(8, 8, 3, padding=1, groups=8),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU6(),
    )
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 1.5)
    return model.train(training)


def opforge_layers(model):
    return [m for m in model.modules() if type(m).__module__.startswith("opforge")]


@pytest.mark.parametrize("inplace", [False, True])
def test_a_faster_optimized_model_stays(monkeypatch, layers_win, inplace):
    model = block()
    calls = whole_model_times(monkeypatch, 20.0, 10.0)
    x = torch.randn(2, 4, 16, 16)
    fast, report = opforge.optimize(model, example_inputs=(x,), inplace=inplace, report=True)
    assert len(calls) == 1
    assert opforge_layers(fast) and len(report.replaced) == 2
    assert any(n.startswith("the whole model optimized: 0.01 ms vs 0.02 ms as it was, forward") for n in report.notes)
    assert (fast is model) == inplace


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("optimized_us", [20.0, 9.8])  # slower; faster, but by less than the 3% margin
def test_a_slower_optimized_model_is_put_back(monkeypatch, layers_win, inplace, optimized_us):
    model = block()
    original = copy.deepcopy(model)
    children = list(model.children())
    whole_model_times(monkeypatch, 10.0, optimized_us)
    x = torch.randn(2, 4, 16, 16)
    fast, report = opforge.optimize(model, example_inputs=(x,), inplace=inplace, report=True)
    assert not opforge_layers(fast)
    assert [type(m) for m in fast.modules()] == [type(m) for m in original.modules()]
    if inplace:
        assert fast is model and list(model.children()) == children  # the very modules it had
    assert report.replaced == [] and len(report.layers) == 2
    assert all(r.reason.endswith("faster alone, but the whole model was not: put back") for r in report.layers)
    times = f"{optimized_us / 1e3:.2f} ms vs 0.01 ms as it was, forward"
    assert any(f"is not 3% faster ({times}): put back as it was" in n for n in report.notes)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), original(x), rtol=0, atol=0)
    torch.testing.assert_close(fast.state_dict(), original.state_dict(), rtol=0, atol=0)


def test_put_back_in_place_keeps_hooks_removable_and_the_optimizer_stepping(monkeypatch, layers_win):
    model = block(training=True)
    seen = []
    handle = model[0].register_forward_hook(lambda *a: seen.append(1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    whole_model_times(monkeypatch, 10.0, 20.0)
    x = torch.randn(2, 4, 16, 16)
    fast = opforge.optimize(model, example_inputs=(x,), inplace=True)
    assert fast is model and type(model[0]) is torch.nn.Conv2d
    fast(x).square().mean().backward()
    before = model[0].weight.detach().clone()
    opt.step()
    assert not torch.equal(model[0].weight.detach(), before)
    assert seen
    handle.remove()
    seen.clear()
    fast(x)
    assert not seen


def test_a_model_nothing_changed_in_is_not_timed(monkeypatch):
    calls = whole_model_times(monkeypatch, 10.0, 20.0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    opforge.optimize(model, example_inputs=(torch.randn(2, 4),))
    assert calls == []


def test_no_check_without_example_inputs_or_with_force(monkeypatch, layers_win):
    calls = whole_model_times(monkeypatch, 10.0, 20.0)
    x = torch.randn(2, 4, 16, 16)
    assert opforge_layers(opforge.optimize(block(), example_inputs=(x,), force=True))
    opforge.optimize(block())
    assert calls == []


def test_the_verdict_is_cached_per_architecture(monkeypatch, layers_win):
    calls = whole_model_times(monkeypatch, 20.0, 10.0)
    x = torch.randn(2, 4, 16, 16)
    opforge.optimize(block(), example_inputs=(x,))
    opforge.optimize(block(), example_inputs=(x,))
    assert len(calls) == 1
    opforge.optimize(block(), example_inputs=(torch.randn(3, 4, 16, 16),))
    assert len(calls) == 2


def test_a_failing_timing_keeps_the_layers_own_choices(monkeypatch, layers_win):
    def fail(*args):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(optimize_guard, "_timed", fail)
    fast, report = opforge.optimize(block(), example_inputs=(torch.randn(2, 4, 16, 16),), report=True)
    assert opforge_layers(fast)
    assert any("the whole model not timed (RuntimeError: CUDA out of memory)" in n for n in report.notes)


@pytest.mark.parametrize("model_name", ["mobilenet_v2", "resnet18"])
def test_timed_for_real_in_training_the_caller_sees_no_trace(layers_win, model_name):
    # The real clock decides: whichever way it goes, statistics, gradients and outputs are as they were.
    model = train_model(model_name, "cpu")
    x = torch.randn(2, 3, 64, 64)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    stats = copy.deepcopy(model.state_dict())
    reference = copy.deepcopy(model)
    fast, report = opforge.optimize(model, example_inputs=(x,), report=True)
    torch.testing.assert_close(model.state_dict(), stats, rtol=0, atol=0)
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in model.parameters())
    whole = [n for n in report.notes if n.startswith("the whole model")]
    assert len(whole) == 1
    put_back = "put back as it was" in whole[0]
    assert put_back == (report.replaced == [])
    torch.testing.assert_close(fast.state_dict(), stats, rtol=0, atol=0)
    torch.manual_seed(0)
    out = fast(x)
    torch.manual_seed(0)
    torch.testing.assert_close(out, reference(x), rtol=1e-4, atol=1e-4)


def test_timed_for_real_in_eval_both_versions_run_in_turns(monkeypatch, layers_win):
    order = []
    real = optimize_layout._median_us  # the two versions are timed in turns by optimize_layout's clock

    def spy(fn, device, calls, repeats, sample_s):
        order.append(fn)
        return real(fn, device, calls=calls, repeats=repeats, sample_s=sample_s)

    monkeypatch.setattr(optimize_layout, "_median_us", spy)
    model = block()
    fast, report = opforge.optimize(model, example_inputs=(torch.randn(2, 4, 16, 16),), report=True)
    assert len(order) == 2 * optimize_guard._ROUNDS
    assert order[0] is not order[1] and all(f is order[i % 2] for i, f in enumerate(order))
    assert sum(n.startswith("the whole model") for n in report.notes) == 1


def test_model_state_puts_back_children_parameters_buffers_hooks_and_mode():
    model = block()
    state = optimize_guard.ModelState(model)
    conv, hooks = model[0], model._forward_pre_hooks
    assert not state.changed()
    model[0] = torch.nn.Identity()
    model[1].weight = torch.nn.Parameter(torch.ones(8))
    model[1].register_buffer("extra", torch.zeros(1))
    model.register_forward_pre_hook(lambda *a: None)
    model.train()
    assert state.changed()
    state.apply()
    assert model[0] is conv and model._forward_pre_hooks is hooks and not hooks
    assert "extra" not in model[1]._buffers and not model.training and not state.changed()


def test_the_verdict_is_per_layout_inside(monkeypatch, layers_win):
    # The same architecture optimized with and without the channels_last hooks: two models, two timings.
    calls = whole_model_times(monkeypatch, 20.0, 10.0)
    x = torch.randn(2, 4, 16, 16)
    opforge.optimize(block(), example_inputs=(x,))

    def inside(model, inputs):
        optimize_layout.install_channels_last(model)
        return True, "NCHW inputs run as channels_last inside"

    monkeypatch.setattr(optimize_module, "choose_channels_last", inside)
    fast = opforge.optimize(block(), example_inputs=(x,))
    assert optimize_layout.has_channels_last_hooks(fast) and len(calls) == 2
