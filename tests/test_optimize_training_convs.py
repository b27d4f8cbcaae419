"""optimize in training mode: a chain's conv alone as opforge's layer where it times faster.

Which layers win is a timing, so here every timing is made a win (monkeypatched): the
replacement path then always runs, whatever the machine's load. The BatchNorm and the
activation stay modules; nothing is folded."""

import copy
import importlib

import pytest
import torch
from training_models import step, train_model

import opforge

optimize_module = importlib.import_module("opforge.optimize")


@pytest.fixture
def opforge_always_wins(monkeypatch):
    def win(*args, **kwargs):
        return True, "measured 1.0 us vs 2.0 us for torch's layers", 1.0

    monkeypatch.setattr(optimize_module, "faster_with_opforge", win)


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
    assert chains and all(r.action.endswith("kept)") and "the conv alone: measured" in r.reason for r in chains)
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
