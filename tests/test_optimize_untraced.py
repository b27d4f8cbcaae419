"""opforge.optimize on models fx cannot trace whole, and on torchvision's FrozenBatchNorm2d.

A detection model's forward has control flow; its backbone's blocks trace on
their own and are optimized like a classifier's. Detection backbones hold
FrozenBatchNorm2d (fixed statistics and affine): folded in eval mode like
BatchNorm2d, left alone in training mode (folded, the conv would train
another weight). Without ``example_inputs`` optimize only folds, which keeps
these tests quick.
"""

import pytest
import torch
from reference import randomize_batchnorm

import opforge
from opforge.optimize_fold import folded_weight_and_bias

torchvision = pytest.importorskip("torchvision")
FrozenBatchNorm2d = torchvision.ops.misc.FrozenBatchNorm2d


class _ConvBnRelu(torch.nn.Module):
    """No Sequential: only a trace of its forward shows the chain."""

    def __init__(self, cin, cout, norm=torch.nn.BatchNorm2d):
        super().__init__()
        self.conv = torch.nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        self.bn = norm(cout)
        self.act = torch.nn.ReLU()

    def forward(self, x):
        return self.act(self.bn(self.conv(x)))


class _Untraceable(torch.nn.Module):
    """Control flow on a tensor's value: fx cannot trace this forward."""

    def __init__(self, norm=torch.nn.BatchNorm2d):
        super().__init__()
        self.stem = _ConvBnRelu(3, 8, norm)
        self.body = torch.nn.ModuleDict({"a": _ConvBnRelu(8, 8, norm), "b": _ConvBnRelu(8, 4, norm)})

    def forward(self, x):
        x = self.stem(x)
        if x.mean() > 0:  # fx: a Proxy cannot be used as a bool
            x = self.body["a"](x)
        return self.body["b"](x)


def _norms(model, kind):
    return [m for m in model.modules() if isinstance(m, kind)]


@pytest.mark.parametrize("norm", [torch.nn.BatchNorm2d, FrozenBatchNorm2d])
def test_an_untraceable_model_is_optimized_block_by_block(norm):
    torch.manual_seed(0)
    model = randomize_batchnorm(_Untraceable(norm)).eval()
    with pytest.raises(torch.fx.proxy.TraceError):
        torch.fx.symbolic_trace(model)  # the premise: the model itself does not trace
    fast, report = opforge.optimize(model, report=True)
    rows = {row.conv: row for row in report.layers}
    assert set(rows) == {"stem.conv", "body.a.conv", "body.b.conv"}, str(report)
    assert all(row.action.startswith("BatchNorm folded") for row in rows.values()), str(report)
    assert not _norms(fast, norm) and len(_norms(model, norm)) == 3  # the original keeps its own
    x = torch.rand(2, 3, 12, 12)  # positive: the branch runs
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x), atol=1e-5, rtol=1e-5)


def test_frozen_batch_norm_fold_math_is_exact_in_float64():
    conv = torch.nn.Conv2d(5, 7, 3, padding=1, dtype=torch.float64)
    bn = randomize_batchnorm(torch.nn.Sequential(FrozenBatchNorm2d(7))).double()[0]
    x = torch.randn(2, 5, 9, 9, dtype=torch.float64)
    w, b = folded_weight_and_bias(conv.weight, conv.bias, bn)
    expected = bn(conv(x))
    torch.testing.assert_close(torch.nn.functional.conv2d(x, w, b, padding=1), expected, atol=1e-10, rtol=1e-10)


def _frozen_resnet18():
    torch.manual_seed(0)
    return randomize_batchnorm(torchvision.models.resnet18(num_classes=10, norm_layer=FrozenBatchNorm2d))


def test_frozen_batch_norm_resnet_is_folded_in_eval_mode():
    model = _frozen_resnet18().eval()
    fast, report = opforge.optimize(model, report=True)
    assert not _norms(fast, FrozenBatchNorm2d), str(report)  # the residual tails' too
    assert "FrozenBatchNorm2d" in str(report)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        ref = model(x)
        torch.testing.assert_close(fast(x), ref, atol=2e-4 * ref.abs().max().item(), rtol=2e-4)


def test_frozen_batch_norm_is_left_in_training_mode():
    model = _frozen_resnet18().train()
    fast, report = opforge.optimize(model, report=True)
    frozen_rows = [row for row in report.layers if "FrozenBatchNorm2d" in row.pattern]
    assert frozen_rows and all(row.action == "left" for row in frozen_rows), str(report)
    assert all("FrozenBatchNorm2d is folded in eval mode only" in row.reason for row in frozen_rows)
    assert len(_norms(fast, FrozenBatchNorm2d)) == len(_norms(model, FrozenBatchNorm2d))
    x = torch.randn(2, 3, 64, 64)
    torch.testing.assert_close(fast(x).sum(), model(x).sum(), atol=0, rtol=0)


def test_frozen_batch_norm_is_folded_whatever_its_own_mode():
    """Its output does not depend on ``training``: a FrozenBatchNorm2d built after ``eval()``
    (a backbone frozen in place) is folded into an eval-mode conv all the same."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU()).eval()
    model.insert(1, randomize_batchnorm(torch.nn.Sequential(FrozenBatchNorm2d(8)))[0])
    assert model[1].training and not model[0].training
    fast, report = opforge.optimize(model, report=True)
    assert type(fast[1]) is torch.nn.Identity and report.layers[0].action.startswith("BatchNorm folded")
    x = torch.randn(2, 3, 10, 10)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x), atol=1e-5, rtol=1e-5)


def test_detection_backbone_is_reached():
    torch.manual_seed(0)
    model = torchvision.models.get_model(
        "fasterrcnn_mobilenet_v3_large_320_fpn", weights=None, weights_backbone=None, num_classes=3
    )
    model = randomize_batchnorm(model).eval()
    fast, report = opforge.optimize(model, report=True)
    folded = [row for row in report.layers if row.conv.startswith("backbone.body.") and "folded" in row.action]
    assert len(folded) >= 40, str(report)  # every conv -> BatchNorm of the mobilenet body
    assert not _norms(fast.backbone, torch.nn.BatchNorm2d)
    x = torch.randn(1, 3, 96, 96)
    with torch.no_grad():
        ref, got = model.backbone(x), fast.backbone(x)
        for key in ref:
            scale = ref[key].abs().max().item()
            torch.testing.assert_close(got[key], ref[key], atol=1e-4 * scale, rtol=1e-4)
        fast([torch.rand(3, 96, 120)])  # the whole model still runs


class _OptionalInput(torch.nn.Module):
    """A forward with an optional argument, as DLA's tree nodes: a trace would pass a proxy for
    ``skip`` and take the branch of a given one, which calls without it never take."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.relu = torch.nn.ReLU()

    def forward(self, x, skip=None):
        skip = torch.zeros_like(x) if skip is None else skip
        return self.relu(self.bn(self.conv(x)) + skip)


class _CallsWithAndWithout(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = _OptionalInput(), _OptionalInput()

    def forward(self, x):
        y = self.a(x)
        return self.b(y, y)


def test_a_block_with_optional_arguments_is_not_rewritten_from_a_trace():
    torch.manual_seed(0)
    model = randomize_batchnorm(_CallsWithAndWithout()).eval()
    fast, report = opforge.optimize(model, report=True, force=True)
    assert type(fast.a) is _OptionalInput and type(fast.b) is _OptionalInput  # not graphs of themselves
    assert {row.conv for row in report.layers} == {"a.conv", "b.conv"}, str(report)  # found from the model's trace
    x = torch.randn(2, 8, 10, 10)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(fast.a(x), model.a(x), atol=1e-5, rtol=1e-5)  # called without skip


class _ReachesIn(torch.nn.Module):
    """An untraceable parent that also calls its child's conv on its own: folding the child's
    BatchNorm into that conv would change the parent's second call."""

    def __init__(self):
        super().__init__()
        self.inner = _ConvBnRelu(4, 4)
        self.head = torch.nn.Conv2d(4, 2, 1)

    def forward(self, x):
        y = self.inner(x)
        if y.mean() > 0:
            y = y + self.inner.conv(x)
        return self.head(y)


class _PassesNone(torch.nn.Module):
    """Calls a two-argument block with None: a trace of the block alone would take the other branch."""

    def __init__(self):
        super().__init__()
        self.block = _TwoArguments()

    def forward(self, x):
        return self.block(x, None) if x.mean() > -100 else x


class _TwoArguments(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 4, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(4)
        self.relu = torch.nn.ReLU()

    def forward(self, x, skip):
        y = self.bn(self.conv(x))
        return self.relu(y) - y if skip is None else self.relu(y) + skip


class _LoopsOverLevels(torch.nn.Module):
    """A detection head: one conv applied to each level of a list (fx cannot iterate a proxy)."""

    def __init__(self):
        super().__init__()
        self.tower = torch.nn.Sequential(torch.nn.Conv2d(4, 4, 3, padding=1), torch.nn.ReLU())
        self.logits = torch.nn.Conv2d(4, 3, 3, padding=1)
        torch.nn.init.normal_(self.logits.weight, std=0.01)  # __init__ reads the layer: no use at run time

    def forward(self, levels):
        return [self.logits(self.tower(x)) for x in levels]


@pytest.mark.parametrize("model_class", [_ReachesIn, _PassesNone, _LoopsOverLevels])
def test_untraceable_parents_keep_their_outputs(model_class):
    torch.manual_seed(0)
    model = randomize_batchnorm(model_class()).eval()
    x = torch.rand(2, 4, 8, 8)  # positive: _ReachesIn's branch runs
    args = ([x, x[:, :, :4, :4]],) if model_class is _LoopsOverLevels else (x,)
    fast, report = opforge.optimize(model, report=True, force=True)
    rows = {row.conv: row for row in report.layers}
    if model_class is _ReachesIn:
        assert "inner.conv" not in rows and type(fast.inner.bn) is torch.nn.BatchNorm2d, str(report)
    if model_class is _PassesNone:
        assert rows["block.conv"].pattern == "Conv2d(3x3, dense, s1)", str(report)  # the conv alone
        assert type(fast.block) is _TwoArguments  # not a graph of its given-skip branch
    if model_class is _LoopsOverLevels:
        assert set(rows) == {"tower.0", "logits"} and rows["logits"].action != "left", str(report)
    with torch.no_grad():
        torch.testing.assert_close(fast(*args), model(*args), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("timed", [False, True])
def test_a_scripted_child_is_left_as_compiled(timed):
    # Its compiled code calls what it was compiled with: nothing inside it is replaced, the rest is.
    inner = randomize_batchnorm(torch.nn.Sequential(_ConvBnRelu(3, 8)).eval())
    scripted = torch.jit.script(inner)
    model = randomize_batchnorm(
        torch.nn.Sequential(scripted, torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.BatchNorm2d(8)).eval()
    )
    x = torch.randn(2, 3, 16, 16)
    fast, report = opforge.optimize(model, example_inputs=(x,) if timed else None, report=True)
    assert isinstance(fast[0], torch.jit.ScriptModule)
    assert [r.conv for r in report.layers] == ["1"] and report.layers[0].action.startswith("BatchNorm folded")
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x), rtol=1e-5, atol=1e-5)
