"""opforge.optimize beyond the four benchmark models: architectures whose blocks differ.

efficientnet_b0 (SiLU, squeeze-excitation, 5x5 depthwise), mnasnet0_5 (5x5
depthwise, ReLU), regnet_y_400mf (grouped 3x3 convs, squeeze-excitation),
shufflenet_v2_x0_5 (depthwise convs without activation, channel shuffle) and
densenet121 (BatchNorm before its conv, concatenated inputs), googlenet
(parallel branches, two auxiliary heads whose outputs a training step returns
too) and squeezenet1_1 (convs + ReLU without BatchNorm, a conv as the
classifier): with every layer opforge has a kernel for swapped (force=True),
the outputs in eval mode and the gradients of one training step stay the
original's, in both memory formats.
"""

import pytest
import torch
from reference import randomize_batchnorm

import opforge

torchvision = pytest.importorskip("torchvision")

ARCHITECTURES = [
    "efficientnet_b0",
    "mnasnet0_5",
    "regnet_y_400mf",
    "shufflenet_v2_x0_5",
    "densenet121",
    "googlenet",
    "squeezenet1_1",
]


def _model(name, channels_last):
    torch.manual_seed(0)
    # googlenet's init_weights, named: its default warns of a change to come.
    extra = {"init_weights": True} if name == "googlenet" else {}
    model = randomize_batchnorm(torchvision.models.get_model(name, weights=None, num_classes=10, **extra))
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout) or type(m).__name__ == "StochasticDepth":
            m.p = 0.0  # no random masks: both models see the same activations
    return model.to(memory_format=torch.channels_last if channels_last else torch.contiguous_format)


def _loss(outputs):
    """The sum of squares' means over every output (a training googlenet also returns its aux heads')."""
    if isinstance(outputs, torch.Tensor):
        return outputs.square().mean()
    return sum(o.square().mean() for o in outputs if o is not None)


def _input(channels_last):
    x = torch.randn(2, 3, 64, 64)
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x


def _opforge_layers(model):
    return [m for m in model.modules() if type(m).__module__.startswith("opforge.")]


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_eval_outputs_with_every_layer_swapped(name, channels_last):
    model = _model(name, channels_last).eval()
    fast, report = opforge.optimize(model, report=True, force=True)
    assert _opforge_layers(fast), str(report)
    x = _input(channels_last)
    with torch.no_grad():
        ref = model(x)
        out = fast(x)
    torch.testing.assert_close(out, ref, atol=2e-4 * ref.abs().max().item(), rtol=2e-4)


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_training_step_gradients_with_every_layer_swapped(name, channels_last):
    """One training step: the loss in float32, the gradients in float64.

    A batch of 2 at 64x64 leaves training-mode BatchNorm a few values per channel in the last
    stages, which amplifies rounding: the original's own float32 gradients differ from its
    float64 ones by up to 1.6e-2 of the largest gradient (regnet_y_400mf). A swapped layer that
    rounds differently (conv2d_1x1's GEMM engine) moves float32 gradients about as far, so they
    are compared where rounding is 1e-16: both models in float64."""
    model = _model(name, channels_last).train()
    fast = opforge.optimize(model, force=True)
    assert _opforge_layers(fast)
    x = _input(channels_last)
    losses = [_loss(m(x)) for m in (model, fast)]
    losses[1].backward()
    for (param, _), q in zip(model.named_parameters(), fast.parameters(), strict=True):
        assert q.grad is not None and q.grad.isfinite().all(), param
    model64 = _model(name, channels_last).train().double()
    fast64 = opforge.optimize(model64, force=True)
    assert _opforge_layers(fast64)
    losses64 = [_loss(m(x.double())) for m in (model64, fast64)]
    for loss in losses64:
        loss.backward()
    torch.testing.assert_close(losses64[1], losses64[0], atol=0, rtol=1e-12)
    # The float32 loss: within 1e-5 of the float64 one, or no farther than twice the original's
    # float32 loss is (googlenet's three heads: the original's own is 9e-6 away).
    exact = losses64[0].item()
    off = abs(losses[1].item() - exact)
    assert off <= max(1e-5 * abs(exact), 2 * abs(losses[0].item() - exact)), (losses[1].item(), losses[0].item(), exact)
    # A gradient that cancels to near zero (densenet's first BatchNorm weight) is rounding noise
    # relative to itself: the absolute floor scales with the model's largest gradient.
    scale = max(p.grad.abs().max().item() for p in model64.parameters() if p.grad is not None)
    for (param, p), q in zip(model64.named_parameters(), fast64.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-12 * scale, rtol=1e-9, msg=lambda m, n=param: f"{n}: {m}")
