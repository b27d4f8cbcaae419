"""optimize's one model-level choice: an NCHW model runs channels_last inside (CPU and CUDA).

On CUDA the float32 convolutions run without TF32 here, so both layouts compare at float32's
tolerance."""

import copy
import sys
import threading

import pytest
import torch
from layout_timings import mocked_layout_timings
from reference import randomize_batchnorm, saved_and_loaded

import opforge
from opforge import nn_prepacked_ops, optimize_layout

torchvision = pytest.importorskip("torchvision")


def timings(monkeypatch, inside_us: float, nchw_us: float, optimized: tuple[float, float] | None = None):
    """Make the model-level timing say channels_last inside takes inside_us, NCHW nchw_us; and, where
    a CPU eval model keeps NCHW, the optimized model's second look ``optimized`` (the same by default)."""
    mocked_layout_timings(monkeypatch, [(inside_us, nchw_us), optimized or (inside_us, nchw_us)])


def test_the_choice_is_made_once_per_architecture(monkeypatch):
    """Two optimize calls of one model take one decision, so their state dicts match."""
    timings(monkeypatch, 5.0, 10.0)
    model = torchvision.models.resnet18(num_classes=10).eval()
    x = torch.randn(1, 3, 32, 32)
    first = opforge.optimize(model, example_inputs=(x,))
    timings_now = dict(optimize_layout._timings)
    monkeypatch.setattr(optimize_layout, "_interleaved_us", lambda *args, **kwargs: pytest.fail("timed twice"))
    second = opforge.optimize(model, example_inputs=(x,))
    assert optimize_layout._timings == timings_now
    second.load_state_dict(first.state_dict())


def layouts_seen(model, x):
    """The memory format of every 4-d input a leaf module of ``model`` receives for ``x``."""
    seen = []

    def hook(module, args):
        if args and isinstance(args[0], torch.Tensor) and args[0].dim() == 4 and args[0].shape[1] > 1:
            cl = args[0].is_contiguous(memory_format=torch.channels_last)
            if cl != args[0].is_contiguous():  # a 1x1 plane is both
                seen.append("cl" if cl else "nchw")

    handles = [m.register_forward_pre_hook(hook) for m in model.modules() if not list(m.children())]
    with torch.no_grad():
        model(x)
    for h in handles:
        h.remove()
    return seen


@pytest.fixture
def no_tf32():
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        yield


def test_faster_channels_last_is_taken_and_invisible_to_the_caller(monkeypatch, device, no_tf32):
    timings(monkeypatch, 5.0, 10.0)
    model = randomize_batchnorm(torchvision.models.mobilenet_v2(num_classes=10)).eval().to(device)
    x = torch.randn(1, 3, 64, 64, device=device)
    fast, report = opforge.optimize(model, example_inputs=(x,), report=True)
    assert optimize_layout.has_channels_last_hooks(fast)
    assert report.notes and "channels_last inside" in report.notes[0], str(report)
    assert str(report).startswith("model: NCHW inputs run as channels_last inside")
    assert set(layouts_seen(fast, x)) == {"cl"}
    assert not optimize_layout.has_channels_last_hooks(model)  # the original is untouched
    for p in fast.parameters():  # the parameters keep their memory format
        assert p.is_contiguous()
    with torch.no_grad():
        ref = model(x)
        out = fast(x)
    assert out.stride() == ref.stride()
    torch.testing.assert_close(out, ref, atol=2e-4 * ref.abs().max().item(), rtol=2e-4)


def test_slower_channels_last_is_not_taken(monkeypatch, device):
    timings(monkeypatch, 10.0, 10.0)  # a tie is not a win
    model = randomize_batchnorm(torchvision.models.resnet18(num_classes=10)).eval().to(device)
    x = torch.randn(1, 3, 32, 32, device=device)
    fast, report = opforge.optimize(model, example_inputs=(x,), report=True)
    assert not optimize_layout.has_channels_last_hooks(fast)
    assert "not faster" in report.notes[0]
    assert set(layouts_seen(fast, x)) == {"nchw"}
    # the second look, with opforge's layers, ties too
    assert "NCHW kept with opforge's layers too" in report.notes[1], str(report)


def test_second_look_with_opforge_layers_can_take_channels_last(monkeypatch, device, no_tf32):
    """torch's convs copy an NCHW weight for every channels_last input; opforge's layers reorder
    (CPU) or copy (CUDA) theirs once: an eval model that kept NCHW is optimized both ways, and may
    run channels_last inside."""
    timings(monkeypatch, 10.0, 10.0, optimized=(5.0, 10.0))
    model = randomize_batchnorm(torchvision.models.resnet18(num_classes=10)).eval().to(device)
    x = torch.randn(1, 3, 32, 32, device=device)
    fast, report = opforge.optimize(model, example_inputs=(x,), report=True)
    assert "not faster" in report.notes[0]
    assert "channels_last inside with opforge's layers" in report.notes[1], str(report)
    assert optimize_layout.has_channels_last_hooks(fast) and not optimize_layout.has_channels_last_hooks(model)
    assert set(layouts_seen(fast, x)) == {"cl"}
    for p in fast.parameters():
        assert p.is_contiguous()
    with torch.no_grad():
        ref, out = model(x), fast(x)
    assert out.stride() == ref.stride()
    torch.testing.assert_close(out, ref, atol=2e-5 * ref.abs().max().item(), rtol=2e-5)
    # The second look is cached too: optimizing the model again times nothing and decides alike.
    monkeypatch.setattr(optimize_layout, "_interleaved_us", lambda *args, **kwargs: pytest.fail("timed twice"))
    again = opforge.optimize(model, example_inputs=(x,))
    assert optimize_layout.has_channels_last_hooks(again)


def test_no_second_look_where_no_layer_is_opforges(monkeypatch):
    """A model optimize leaves whole (a reflect-padded conv) is in channels_last the model the first
    choice timed: a second timing of it would only measure noise, and does not run."""
    timings(monkeypatch, 10.0, 10.0, optimized=(5.0, 10.0))
    conv = torch.nn.Conv2d(3, 8, 3, padding=1, padding_mode="reflect")
    model = torch.nn.Sequential(conv, torch.nn.ReLU()).eval()
    x = torch.randn(1, 3, 16, 16)
    fast, report = opforge.optimize(model, example_inputs=(x,), report=True)
    assert [row.action for row in report.layers] == ["left"], str(report)
    assert not optimize_layout.has_channels_last_hooks(fast)
    assert report.notes[1] == "NCHW kept: no layer of the model is opforge's in channels_last either", str(report)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x), atol=0, rtol=0)


@pytest.mark.parametrize("inplace", [False, True])
def test_second_look_times_each_layouts_layers_on_that_layout(monkeypatch, inplace):
    """The two optimized models of the second look have their layers timed and chosen on the inputs
    they will see: NCHW for the one, channels_last for the other. In place, the model itself ends up
    as the faster one (its choices remade from the cached timings)."""
    timings(monkeypatch, 10.0, 10.0, optimized=(5.0, 10.0))
    from opforge import optimize_choice

    module = sys.modules["opforge.optimize"]
    layer_inputs, seen, timings_cached = module._layer_inputs, [], []

    def spy(model, names, example_inputs):
        found = layer_inputs(model, names, example_inputs)
        seen.append({layout(args[0]) for args in found.values()} - {None})
        timings_cached.append(len(optimize_choice._cache))
        return found

    def layout(t):  # None where both hold (one channel, or a 1x1 plane)
        cl = t.is_contiguous(memory_format=torch.channels_last)
        return None if cl == t.is_contiguous() else ("cl" if cl else "nchw")

    monkeypatch.setattr(module, "_layer_inputs", spy)
    model = randomize_batchnorm(torchvision.models.resnet18(num_classes=10)).eval()
    original = copy.deepcopy(model)
    x = torch.randn(1, 3, 32, 32)
    fast, report = opforge.optimize(model, example_inputs=(x,), inplace=inplace, report=True)
    assert seen[:2] == [{"nchw"}, {"cl"}], seen
    assert (fast is model) == inplace
    if inplace:  # the third pass, over the model itself, took every choice from the cache
        assert len(seen) == 3 and seen[2] == {"cl"} and len(optimize_choice._cache) == timings_cached[2]
    assert optimize_layout.has_channels_last_hooks(fast)
    assert any(row.action != "left" for row in report.layers), str(report)
    with torch.no_grad():
        ref, out = original(x), fast(x)
    torch.testing.assert_close(out, ref, atol=2e-5 * ref.abs().max().item(), rtol=2e-5)


def test_second_look_keeps_nchw_where_the_channels_last_copy_fails(monkeypatch):
    """An error while optimizing the channels_last copy (a kernel, memory) leaves the NCHW one."""
    timings(monkeypatch, 10.0, 10.0, optimized=(5.0, 10.0))
    module = sys.modules["opforge.optimize"]
    replace_layers = module._replace_layers

    def failing_inside(model, example_inputs, force):
        if optimize_layout.has_channels_last_hooks(model):
            raise RuntimeError("out of memory")
        return replace_layers(model, example_inputs, force)

    monkeypatch.setattr(module, "_replace_layers", failing_inside)
    model = randomize_batchnorm(torchvision.models.resnet18(num_classes=10)).eval()
    x = torch.randn(1, 3, 32, 32)
    fast, report = opforge.optimize(model, example_inputs=(x,), report=True)
    assert not optimize_layout.has_channels_last_hooks(fast)
    assert report.notes[1].startswith("NCHW kept: optimizing the model channels_last inside failed (out of memory")
    with torch.no_grad():
        ref, out = model(x), fast(x)
    torch.testing.assert_close(out, ref, atol=2e-5 * ref.abs().max().item(), rtol=2e-5)


def test_the_choice_is_cached_per_module_settings():
    """Two models alike in their modules and parameters but not in a conv's stride or a pool's
    kernel compute other things: each gets its own timing."""
    model = torchvision.models.resnet18(num_classes=10)
    other = copy.deepcopy(model)
    other.conv1.stride, other.maxpool.kernel_size = (1, 1), 1
    batches = [torch.randn(1, 3, 32, 32)]
    key = optimize_layout._architecture(model, batches)
    assert key != optimize_layout._architecture(other, batches)
    assert key == optimize_layout._architecture(copy.deepcopy(model), batches)


def test_no_second_look_in_training(monkeypatch):
    mocked_layout_timings(monkeypatch, [(10.0, 10.0)])
    model = randomize_batchnorm(torchvision.models.resnet18(num_classes=10)).train()
    fast, report = opforge.optimize(model, example_inputs=(torch.randn(2, 3, 32, 32),), report=True)
    assert not optimize_layout.has_channels_last_hooks(fast)
    assert len(report.notes) == 1 and "not faster" in report.notes[0]


def test_four_d_outputs_come_back_in_nchw(monkeypatch, device, no_tf32):
    timings(monkeypatch, 5.0, 10.0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), randomize_batchnorm(torch.nn.BatchNorm2d(8)), torch.nn.ReLU()
    ).eval()
    model = model.to(device)
    x = torch.randn(2, 3, 16, 16, device=device)
    fast = opforge.optimize(model, example_inputs=(x,))
    assert optimize_layout.has_channels_last_hooks(fast)
    with torch.no_grad():
        out, ref = fast(x), model(x)
    assert out.is_contiguous() and out.stride() == ref.stride()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


class NeedsNCHW(torch.nn.Module):
    """A model whose forward views a conv output as NCHW, which channels_last strides cannot."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        return y.view(y.shape[0], -1)  # merges C, H and W: only NCHW strides allow it


def test_a_model_that_needs_nchw_strides_keeps_nchw(monkeypatch):
    timings(monkeypatch, 5.0, 10.0)
    model = NeedsNCHW().eval()
    x = torch.randn(2, 3, 8, 8)
    fast, report = opforge.optimize(model, example_inputs=(x,), report=True)
    assert not optimize_layout.has_channels_last_hooks(fast)
    assert "does not run channels_last inside" in report.notes[0]
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x))


def test_not_considered_for_channels_last_inputs_or_no_example(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("no model-level timing expected")

    monkeypatch.setattr(optimize_layout, "_interleaved_us", fail)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU()).eval()
    x = torch.randn(2, 3, 8, 8)
    cases = [
        (model, (x.contiguous(memory_format=torch.channels_last),)),  # already channels_last
        (torch.nn.Linear(3, 3).eval(), (torch.randn(2, 3),)),  # no 4-d input
    ]
    for m, inputs in cases:
        fast, report = opforge.optimize(m, example_inputs=inputs, report=True)
        assert not optimize_layout.has_channels_last_hooks(fast) and not report.notes
    fast = opforge.optimize(model)  # without example inputs nothing is timed
    assert not optimize_layout.has_channels_last_hooks(fast)


def smooth_net(device):
    """conv -> BatchNorm -> SiLU blocks (dense, depthwise, 1x1) and a dropout: no ReLU or max pool,
    whose kinks let float32 rounding flip a gradient's path (torch's own float32 step is then off
    its float64 one by up to 5e-2 of a gradient, in either layout)."""
    blocks = []
    layers = ((3, 32, 3, 1, 2), (32, 32, 3, 32, 1), (32, 64, 1, 1, 1), (64, 64, 3, 1, 1))
    for cin, cout, kernel, groups, stride in layers:
        conv = torch.nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False)
        blocks += [conv, torch.nn.BatchNorm2d(cout), torch.nn.SiLU()]
    head = [torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Dropout(0.5), torch.nn.Linear(64, 10)]
    return randomize_batchnorm(torch.nn.Sequential(*blocks, *head)).to(device).train()


def test_training_model_runs_channels_last_inside_with_the_same_step(monkeypatch, device, no_tf32):
    """In training mode the choice is timed on a copy: the model's statistics, gradients and the
    caller's random stream stay as they were, and a step of the hooked model is the original's."""
    timings(monkeypatch, 5.0, 10.0)
    model = smooth_net(device)
    x = torch.randn(8, 3, 32, 32, device=device)
    before = copy.deepcopy(model.state_dict())
    torch.manual_seed(7)
    fast, report = opforge.optimize(model, example_inputs=(x,), report=True, inplace=True)
    drawn = torch.rand(4, device=device)
    torch.manual_seed(7)
    assert torch.equal(drawn, torch.rand(4, device=device))  # the caller's random stream is untouched
    assert fast is model and optimize_layout.has_channels_last_hooks(fast)
    assert "channels_last inside" in report.notes[0] and "forward + backward" in report.notes[0], str(report)
    for name, value in fast.state_dict().items():  # statistics and counters as they were
        assert torch.equal(value, before[name]), name
    assert all(p.grad is None for p in fast.parameters())
    for p in fast.parameters():  # the parameters keep their memory format
        assert p.is_contiguous()

    reference = smooth_net(device)
    reference.load_state_dict(before)
    reference.double()
    for m in (reference, fast):  # CUDA draws float64's dropout masks from another stream than float32's
        m[-2].p = 0.0
    losses = []
    for m, inputs in ((reference, x.double()), (fast, x)):
        torch.manual_seed(3)
        loss = m(inputs).square().mean()
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0].float(), atol=1e-5, rtol=1e-4)
    grads = dict(reference.named_parameters())
    for name, p in fast.named_parameters():
        ref = grads[name].grad.float()
        assert p.grad.shape == ref.shape and p.grad.is_contiguous(), name
        torch.testing.assert_close(p.grad, ref, atol=1e-3 * ref.abs().max().item(), rtol=1e-3)
    assert set(layouts_seen(fast.eval(), x)) == {"cl"}


class ReadsNCHWMemory(torch.nn.Module):
    """Reads a conv output's memory as if it were NCHW: right values only in NCHW strides."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.norm = torch.nn.BatchNorm2d(8)

    def forward(self, x):
        y = self.norm(self.conv(x))
        c, h, w = y.shape[1:]
        return torch.as_strided(y, y.shape, (c * h * w, h * w, w, 1))


def test_half_type_training_models_compare_layouts_in_float32(monkeypatch):
    timings(monkeypatch, 5.0, 10.0)
    x = torch.randn(4, 3, 8, 8, dtype=torch.bfloat16)
    wrong = ReadsNCHWMemory().to(torch.bfloat16).train()
    fast, report = opforge.optimize(wrong, example_inputs=(x,), report=True)
    assert not optimize_layout.has_channels_last_hooks(fast)
    assert "outputs differ" in report.notes[0], str(report)
    right = smooth_net("cpu").to(torch.bfloat16)
    inputs = (torch.randn(4, 3, 16, 16, dtype=torch.bfloat16),)
    assert optimize_layout._same_in_float32(right, inputs, torch.device("cpu"))
    assert not optimize_layout._same_in_float32(right.eval(), inputs, torch.device("cpu"))  # training only


class HoldsALock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3)
        self.lock = threading.Lock()  # deepcopy cannot copy it

    def forward(self, x):
        return self.conv(x)


def test_a_training_model_that_does_not_copy_keeps_nchw(monkeypatch):
    timings(monkeypatch, 5.0, 10.0)
    model = HoldsALock().train()
    fast, report = opforge.optimize(model, example_inputs=(torch.randn(2, 3, 8, 8),), inplace=True, report=True)
    assert fast is model and not optimize_layout.has_channels_last_hooks(fast)
    assert "does not copy" in report.notes[0], str(report)


@pytest.mark.parametrize("in_channels, tried", [(3, False), (16, True)])
def test_no_cpu_training_trial_of_a_conv_torch_crashes_on(monkeypatch, in_channels, tried):
    """torch's CPU weight gradient of a strided 1x1 conv on few channels segfaults in channels_last
    (timm's repvgg stem): such a training model is never run channels_last to time it."""
    timings(monkeypatch, 5.0, 10.0)  # channels_last would be taken
    model = torch.nn.Sequential(torch.nn.Conv2d(in_channels, 8, 1, stride=2), torch.nn.ReLU()).train()
    x = torch.randn(2, in_channels, 8, 8)
    fast, report = opforge.optimize(model, example_inputs=(x,), report=True)
    assert optimize_layout.has_channels_last_hooks(fast) == tried, str(report)
    if not tried:
        assert "NCHW kept: torch's CPU backward of a strided 1x1 conv" in report.notes[0] and "(0)" in report.notes[0]
        assert optimize_layout.has_channels_last_hooks(opforge.optimize(model.eval(), example_inputs=(x,)))


def test_training_choice_times_forward_and_backward(monkeypatch):
    """The timed call of a training model runs its backward (gradients appear, then are dropped)."""
    monkeypatch.setattr(optimize_layout, "_timings", {})
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU()).train()
    probe = copy.deepcopy(model)
    backwards = []
    probe[0].weight.register_hook(lambda g: backwards.append(g.shape))
    call = optimize_layout._one_call(probe, (torch.randn(2, 3, 8, 8),))
    out = call()
    assert backwards == [probe[0].weight.shape] and not out.requires_grad
    assert probe[0].weight.grad is None  # dropped after each timed call
    calls_before = len(backwards)
    optimize_layout._one_call(probe.eval(), (torch.randn(2, 3, 8, 8),))()
    assert len(backwards) == calls_before  # eval: a forward only


def test_hooked_model_copies_pickles_compiles_exports_and_reoptimizes(monkeypatch):
    timings(monkeypatch, 5.0, 10.0)
    model = randomize_batchnorm(torchvision.models.resnet18(num_classes=10)).eval()
    x = torch.randn(1, 3, 32, 32)
    fast = opforge.optimize(model, example_inputs=(x,))
    assert optimize_layout.has_channels_last_hooks(fast)
    again = opforge.optimize(fast, example_inputs=(x,))  # no second pair of hooks
    assert sum(h is optimize_layout.channels_last_inputs for h in again._forward_pre_hooks.values()) == 1
    loaded = saved_and_loaded(fast)
    assert optimize_layout.has_channels_last_hooks(loaded)
    torch._dynamo.reset()
    compiled = torch.compile(fast, fullgraph=True)
    exported = torch.export.export(fast, (x,)).module()
    with torch.no_grad():
        ref = model(x)
        tol = dict(atol=2e-4 * ref.abs().max().item(), rtol=2e-4)
        for other in (copy.deepcopy(fast), loaded, compiled, exported, again):
            torch.testing.assert_close(other(x), ref, **tol)


def test_layouts_may_differ_by_rounding_not_by_values():
    """The outputs check tolerates another algorithm's rounding, not a forward that reads NCHW strides."""
    y = torch.randn(4, 10)
    assert optimize_layout._same(y * (1 + 1e-6), y)
    assert not optimize_layout._same(y.flip(1), y)
    assert not optimize_layout._same(y.to(torch.float64), y)  # another dtype
    half = y.to(torch.bfloat16)
    assert optimize_layout._same(half, half.clone()) and not optimize_layout._same(half.flip(1), half)


@pytest.mark.cuda
def test_on_cuda_nchw_weights_are_copied_to_channels_last_once(monkeypatch, no_tf32):
    """cuDNN takes a channels_last input with a channels_last weight: an NCHW model run
    channels_last inside would copy each NCHW weight on every call; opforge's layers copy it once."""
    timings(monkeypatch, 5.0, 10.0)
    model = randomize_batchnorm(torchvision.models.resnet18(num_classes=10)).eval().cuda()
    x = torch.randn(1, 3, 64, 64, device="cuda")
    fast = opforge.optimize(model, example_inputs=(x,))
    with torch.no_grad():
        out, ref = fast(x), model(x)
    torch.testing.assert_close(out, ref, atol=1e-4 * ref.abs().max().item(), rtol=1e-4)
    layers = [m for m in fast.modules() if isinstance(m, opforge.nn.PrepackedConv2d)]
    assert any(m.kernel_size == (7, 7) for m in layers), fast  # the stem, folded
    for m in layers:
        assert m.weight.is_contiguous()  # the parameter keeps its format
        if m.kernel_size != (1, 1):  # a 1x1 kernel's NCHW weight is channels_last too: nothing to copy
            assert nn_prepacked_ops.cached_channels_last(m.weight) is not None, m


def test_cuda_timing_copy_has_the_folded_convs_weights_in_channels_last(monkeypatch):
    """On CUDA, channels_last inside is timed as optimize's layers will run: the convs a BatchNorm
    follows hand cuDNN channels_last weights. The copy says so; the model keeps its weights.
    (The predicate is CUDA's; here it is asked of CPU weights.)"""
    monkeypatch.setattr(
        optimize_layout,
        "copies_weight_once",
        lambda conv: not conv.weight.is_contiguous(memory_format=torch.channels_last),
    )
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3)
    ).eval()
    inside = optimize_layout._with_folded_weights_copied(model)
    assert inside[0].weight.is_contiguous(memory_format=torch.channels_last) and not inside[0].weight.is_contiguous()
    assert inside[3].weight.is_contiguous()  # no BatchNorm after it: torch's conv, copying per call
    assert model[0].weight.is_contiguous() and inside[0].weight is not model[0].weight
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(inside(x), model(x))


def test_the_layouts_are_timed_in_turns(monkeypatch):
    """A host whose speed drifts while the two are timed must shift both alike: rounds alternate."""
    order = []
    monkeypatch.setattr(optimize_layout, "_median_us", lambda fn, *a, **k: (order.append(fn), 1.0)[1])
    assert optimize_layout._interleaved_us("inside", "nchw", torch.device("cpu"), rounds=3) == (1.0, 1.0)
    assert order == ["inside", "nchw"] * 3


def test_the_cached_choice_is_per_device():
    model = torch.nn.Conv2d(3, 8, 3)
    key = optimize_layout._architecture(model, [torch.randn(1, 3, 8, 8)])
    assert "cpu" in key[-1][0]


@pytest.mark.cuda
def test_traced_on_cuda_the_hooks_leave_the_layout_to_inductor():
    x = torch.randn(2, 3, 8, 8, device="cuda")
    model = torch.nn.Identity()

    def hooked(t):
        converted = optimize_layout.channels_last_inputs(model, (t,), {})
        inside = converted[0][0] if converted is not None else t
        back = optimize_layout.nchw_outputs(model, (t,), {}, inside)
        return inside.is_contiguous(), (back if back is not None else inside).is_contiguous()

    assert hooked(x) == (False, True)  # eager: channels_last inside, NCHW out
    torch._dynamo.reset()
    assert torch.compile(hooked, backend="eager", fullgraph=True)(x) == (True, True)
    cpu = torch.randn(2, 3, 8, 8)
    assert torch.compile(hooked, backend="eager", fullgraph=True)(cpu) == (False, True)  # the CPU keeps them


def test_outputs_compare_by_the_strides_that_order_memory():
    """A [1, C, 1, 1] output is contiguous in both layouts whatever its size-1 strides say (a
    channels_last conv gives strides (C, 1, C, C))."""
    nchw = torch.randn(1, 8, 1, 1)
    other_strides = nchw.as_strided(nchw.shape, (8, 1, 8, 8))
    assert nchw.stride() != other_strides.stride()
    assert optimize_layout._same(nchw, other_strides)
    plane = torch.randn(1, 8, 2, 2)
    assert not optimize_layout._same(plane, plane.contiguous(memory_format=torch.channels_last))
