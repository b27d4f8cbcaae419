"""opforge.optimize on models called unlike a classifier: two input tensors, dict and list outputs.

A siamese or optical-flow model takes two images and runs one encoder on
each: ``example_inputs`` holds both, each layer is timed on the input it
sees first, and a model that runs channels_last inside converts every 4-d
input and output. A segmentation model returns a dict of tensors; RAFT takes
two images and returns a list of flow estimates, one per refinement step.
"""

import pytest
import torch
from layout_timings import mocked_layout_timings
from reference import randomize_batchnorm

import opforge

torchvision = pytest.importorskip("torchvision")


class _TwoImages(torch.nn.Module):
    """One encoder on each image, the features concatenated: each encoder layer is called twice."""

    def __init__(self):
        super().__init__()
        bn, conv = torch.nn.BatchNorm2d, torch.nn.Conv2d
        self.encoder = torch.nn.Sequential(
            conv(3, 8, 3, padding=1, bias=False),
            bn(8),
            torch.nn.ReLU(),
            conv(8, 8, 3, stride=2, padding=1, groups=8, bias=False),
            bn(8),
            torch.nn.ReLU6(),
            conv(8, 16, 1, bias=False),
            bn(16),
        )
        self.head = torch.nn.Sequential(conv(32, 8, 3, padding=1), torch.nn.ReLU())

    def forward(self, first, second):
        return self.head(torch.cat([self.encoder(first), self.encoder(second)], dim=1))


def _two_images():
    generator = torch.Generator().manual_seed(3)
    return tuple(torch.randn(2, 3, 20, 20, generator=generator) for _ in range(2))


def _close(actual, expected, scale=2e-5):
    torch.testing.assert_close(actual, expected, atol=scale * expected.abs().max().item(), rtol=scale)


def test_two_input_model_in_eval_mode_is_timed_on_both_inputs():
    torch.manual_seed(0)
    model = randomize_batchnorm(_TwoImages()).eval()
    inputs = _two_images()
    fast, report = opforge.optimize(model, example_inputs=inputs, report=True)
    rows = {r.conv: r for r in report.layers}
    assert {"encoder.0", "encoder.3", "encoder.6", "head.0"} <= set(rows), str(report)
    # every chain of the encoder is folded or replaced: timing found each layer's input
    for name in ("encoder.0", "encoder.3", "encoder.6"):
        assert rows[name].action != "left", str(report)
        assert "not called by example_inputs" not in rows[name].reason, str(report)
    with torch.no_grad():
        expected = model(*inputs)
        actual = fast(*inputs)
        swapped = opforge.optimize(model, force=True)(*inputs)
    _close(actual, expected)
    _close(swapped, expected)
    assert actual.is_contiguous(), "an NCHW model's output stays NCHW"


@pytest.mark.parametrize("timed", [True, False])
def test_two_input_model_trains_like_the_original(timed):
    """Untimed (force=True) the encoder's chains become opforge's conv + BatchNorm ops, each called
    twice a step: the running statistics are updated twice, as the modules' are."""
    torch.manual_seed(0)
    model = randomize_batchnorm(_TwoImages()).train()
    inputs = _two_images()
    fast, report = opforge.optimize(model, example_inputs=inputs if timed else None, force=not timed, report=True)
    if not timed:
        assert all(row.action != "left" for row in report.layers), str(report)
    losses = [m(*inputs).square().mean() for m in (model, fast)]
    torch.testing.assert_close(losses[1], losses[0], atol=0, rtol=1e-5)
    for loss in losses:
        loss.backward()
    scale = max(p.grad.abs().max().item() for p in model.parameters())
    # a replaced layer's parameters keep the modules' names (encoder.0.weight, encoder.1.weight)
    for (name, ref), (new_name, p) in zip(model.named_parameters(), fast.named_parameters(), strict=True):
        assert new_name == name and p.grad is not None, name
        torch.testing.assert_close(p.grad, ref.grad, atol=1e-4 * scale, rtol=1e-4)
    # the statistics of the BatchNorms, updated by the two calls of the step, agree too
    for (_, ref), (_, new) in zip(model.named_buffers(), fast.named_buffers(), strict=True):
        if ref.is_floating_point():
            _close(new, ref, scale=1e-5)


def test_segmentation_model_returns_its_dict():
    torch.manual_seed(0)
    model = torchvision.models.segmentation.lraspp_mobilenet_v3_large(
        weights=None, weights_backbone=None, num_classes=5
    )
    model = randomize_batchnorm(model).eval()
    x = torch.randn(1, 3, 64, 64)
    fast, report = opforge.optimize(model, example_inputs=(x,), report=True)
    assert report.replaced, str(report)
    with torch.no_grad():
        expected = model(x)
        actual = fast(x)
    assert type(actual) is type(expected) and list(actual) == list(expected)
    for key in expected:
        _close(actual[key], expected[key], scale=1e-4)
        assert actual[key].is_contiguous()


def test_optical_flow_model_with_two_images_and_a_list_of_outputs():
    torch.manual_seed(0)
    model = randomize_batchnorm(torchvision.models.optical_flow.raft_small(weights=None)).eval()
    generator = torch.Generator().manual_seed(4)
    first, second = (torch.randn(1, 3, 128, 128, generator=generator) for _ in range(2))
    fast, report = opforge.optimize(model, force=True, report=True)
    assert report.replaced, str(report)
    with torch.no_grad():
        expected = model(first, second, num_flow_updates=3)
        actual = fast(first, second, num_flow_updates=3)
    assert len(actual) == len(expected) == 3
    for a, e in zip(actual, expected, strict=True):
        _close(a, e, scale=1e-4)


class _SharedUnevenly(torch.nn.Module):
    """``conv`` runs twice but only its first call feeds ``bn``; ``other`` and ``conv`` share ``bn2``."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 4, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(4)
        self.other = torch.nn.Conv2d(4, 4, 1)
        self.bn2 = torch.nn.BatchNorm2d(4)
        self.tail = torch.nn.Conv2d(4, 4, 1)
        self.bn3 = torch.nn.BatchNorm2d(4)

    def forward(self, x):
        y = self.bn(self.conv(x)) + self.conv(x)
        z = self.bn2(self.other(y)) + self.bn2(self.tail(y))
        return self.bn3(self.tail(z))


def test_a_chain_holds_in_every_call_or_is_no_chain():
    """A BatchNorm joins a conv's chain only where every call of the conv feeds it and it is called
    nowhere else: folded anywhere else, the other calls would compute something else."""
    from opforge.optimize_patterns import find_chains

    chains = {chain.conv: (chain.bn, chain.act) for chain in find_chains(_SharedUnevenly())}
    assert chains == {"conv": (None, None), "other": (None, None), "tail": (None, None)}
    model = randomize_batchnorm(_SharedUnevenly()).eval()
    x = torch.randn(2, 4, 8, 8)
    with torch.no_grad():
        _close(opforge.optimize(model, force=True)(x), model(x))


def test_a_layer_called_on_several_shapes_is_timed_on_the_largest():
    """A head shared by the levels of a feature pyramid spends most of its time on the largest."""
    from opforge.optimize import _layer_inputs

    class Pyramid(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.head = torch.nn.Conv2d(4, 4, 3, padding=1)

        def forward(self, x):
            return [self.head(torch.nn.functional.avg_pool2d(x, 2)), self.head(x)]

    inputs = _layer_inputs(Pyramid(), ["head"], (torch.randn(1, 4, 16, 16),))
    assert inputs["head"][0].shape == (1, 4, 16, 16)


class _ListOfImages(torch.nn.Module):
    """As a detection model: a list of 3-d images in, batched into one NCHW tensor for the backbone.
    The model also calls one of the backbone's layers itself, and a BatchNorm of its own follows the
    backbone's last conv: the one pass over the whole model sees both."""

    def __init__(self):
        super().__init__()
        self.backbone = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1, bias=False),
            torch.nn.BatchNorm2d(8),
            torch.nn.ReLU(),
            torch.nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False),
            torch.nn.BatchNorm2d(8),
            torch.nn.ReLU6(),
            torch.nn.Conv2d(8, 8, 1, bias=False),
        )
        self.norm = torch.nn.BatchNorm2d(8)
        self.head = torch.nn.Conv2d(8, 2, 1)

    def forward(self, images: list[torch.Tensor]):
        batch = torch.stack(images)
        features = self.norm(self.backbone(batch))
        stem = self.backbone[0](batch)
        return {"scores": self.head(features).flatten(1).sigmoid(), "features": features, "stem": stem}


@pytest.mark.parametrize("faster", [True, False])
def test_the_part_that_takes_the_batch_gets_the_layout_choice(monkeypatch, faster):
    """Where channels_last measures faster for the backbone on the batch it gets, the backbone runs
    channels_last inside, its outputs back in NCHW, before the model's layers are timed; the model's
    outputs are the original's, the layer its code calls itself and the BatchNorm after the backbone
    included."""
    from opforge.optimize_layout import has_channels_last_hooks

    mocked_layout_timings(monkeypatch, [(5.0, 10.0) if faster else (10.0, 10.0)])
    torch.manual_seed(0)
    model = randomize_batchnorm(_ListOfImages()).eval()
    images = [torch.randn(3, 12, 12) for _ in range(2)]
    fast, report = opforge.optimize(model, example_inputs=(images,), report=True)
    assert has_channels_last_hooks(fast.backbone) == faster and not has_channels_last_hooks(fast), str(report)
    assert not has_channels_last_hooks(model.backbone)
    expected_note = "NCHW inputs run as channels_last inside" if faster else "NCHW kept: channels_last inside is not"
    assert report.notes[0].startswith(f"backbone (takes the model's NCHW batch): {expected_note}"), str(report)
    assert {"backbone.3", "head"} <= {row.conv for row in report.layers}, str(report)
    with torch.no_grad():
        expected, actual = model(images), fast(images)
    for key in expected:
        _close(actual[key], expected[key])
        assert actual[key].is_contiguous()


def test_no_part_for_a_model_that_takes_its_batch():
    from opforge.optimize_part import find_part

    model = _TwoImages().eval()
    assert find_part(model, _two_images()) is None
    assert find_part(model.train(), ([torch.randn(3, 8, 8)],)) is None


class _ReadsItsLayers(torch.nn.Module):
    """The forward reads a BatchNorm's weight and a conv's weight itself."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(4)
        self.act = torch.nn.ReLU()
        self.scaled = torch.nn.Conv2d(4, 4, 1)
        self.bn2 = torch.nn.BatchNorm2d(4)

    def forward(self, x):
        y = self.act(self.bn(self.conv(x))) * self.bn.weight.view(1, -1, 1, 1)
        return self.bn2(self.scaled(y)) + self.scaled.weight.sum()


@pytest.mark.parametrize("training", [False, True])
def test_layers_whose_tensors_the_forward_reads_are_left(training):
    """The first conv, whose weight nothing else reads, may still be replaced on its own."""
    from opforge.optimize_patterns import Chain, find_chains

    model = randomize_batchnorm(_ReadsItsLayers()).train(training)
    assert find_chains(model) == [Chain("conv")]
    x = torch.randn(2, 3, 8, 8)
    fast, report = opforge.optimize(model, force=True, report=True)
    assert [row.conv for row in report.replaced] == ["conv"], str(report)
    assert type(fast.bn) is torch.nn.BatchNorm2d and type(fast.scaled) is torch.nn.Conv2d
    torch.manual_seed(1)
    expected = model(x)
    torch.manual_seed(1)
    _close(fast(x), expected)
