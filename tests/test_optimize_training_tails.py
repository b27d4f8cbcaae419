"""opforge.optimize on training-mode residual tails: ``relu(bn(conv(x)) + shortcut)`` as one
``conv2d_batch_norm`` call with the shortcut, where opforge's CUDA batch norm engine takes it.

On the CPU the rewrite is not made (the op would run ATen's kernels); with the rule patched
to make it there, the op's ATen path must give the original's values bit for bit in float64,
which checks the graph surgery, the state and the gradients on any machine."""

import copy

import pytest
import torch
from reference import cudnn_flags
from training_models import step, train_model

import opforge
from opforge import optimize_blocks
from opforge.nn_conv_batch_norm import BatchNormInConv

torchvision = pytest.importorskip("torchvision")

TAIL_ACTION = "conv + BatchNorm + add + ReLU as one op"


def tails(report):
    return {row.conv: row for row in report.layers if "-> add ->" in row.pattern}


@pytest.fixture
def tails_everywhere(monkeypatch):
    monkeypatch.setattr(optimize_blocks, "training_tail_pays", lambda conv, bn: True)


@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
def test_training_tails_equal_the_original_in_float64(name, tails_everywhere):
    model = train_model(name).double()
    fast, report = opforge.optimize(copy.deepcopy(model), report=True)
    rows = tails(report)
    kinds = (torchvision.models.resnet.BasicBlock, torchvision.models.resnet.Bottleneck)
    blocks = [n for n, m in model.named_modules() if isinstance(m, kinds)]
    last_conv = "conv2" if name == "resnet18" else "conv3"
    assert sorted(rows) == sorted(f"{b}.{last_conv}" for b in blocks)
    assert all(row.action == TAIL_ACTION for row in rows.values())
    for block in (m for m in fast.modules() if isinstance(m, torch.fx.GraphModule)):
        called = [n for n in block.graph.nodes if n.op == "call_module"]
        tail = [n for n in called if n.target == last_conv]
        assert len(tail) == 1 and len(tail[0].args) == 2, block.code  # the conv's input and the shortcut
        assert not any(isinstance(block.get_submodule(n.target), BatchNormInConv) for n in called), block.code
    assert list(fast.state_dict()) == list(model.state_dict())
    assert [n for n, _ in fast.named_parameters()] == [n for n, _ in model.named_parameters()]
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    assert torch.equal(step(fast, x), step(model, x))
    for (key, a), b in zip(fast.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), key  # parameters after the step, running statistics
    fast.eval()
    model.eval()
    with torch.no_grad():
        assert torch.equal(fast(x), model(x))


def test_training_tails_are_left_on_the_cpu():
    """The op would run ATen's kernels there: the blocks keep their add and ReLU."""
    fast, report = opforge.optimize(train_model("resnet18"), report=True)
    assert not tails(report)


def test_a_shortcut_that_reads_the_conv_is_no_tail(tails_everywhere):
    """``relu(bn(conv(x)) + conv(x))``-like graphs: the shortcut depends on the branch, so the pair stays."""

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn = torch.nn.Conv2d(4, 4, 3, padding=1), torch.nn.BatchNorm2d(4)
            self.relu = torch.nn.ReLU()

        def forward(self, x):
            y = self.bn(self.conv(x))
            return self.relu(y + y * 2)

    model = torch.nn.Sequential(Block()).train()
    fast, report = opforge.optimize(copy.deepcopy(model), report=True)
    assert not tails(report)
    x = torch.randn(2, 4, 8, 8)
    torch.testing.assert_close(fast(x), model(x))


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_training_tails_on_the_cuda_engine(name, dtype):
    """channels_last on CUDA: every tail is fused and runs the engine; one step's loss and the
    gradients against the original in float64 (full float32 convs, deterministic cuDNN)."""
    with cudnn_flags(deterministic=True, allow_tf32=False):
        check_training_step_on_cuda(name, dtype)


def check_training_step_on_cuda(name, dtype):
    model = train_model(name, "cuda").to(dtype=dtype, memory_format=torch.channels_last)
    exact = copy.deepcopy(model).double()
    x = torch.randn(4, 3, 64, 64, device="cuda", dtype=dtype).contiguous(memory_format=torch.channels_last)
    fast, report = opforge.optimize(copy.deepcopy(model), example_inputs=(x,), report=True, force=True)
    rows = tails(report)
    assert rows and all(row.action == TAIL_ACTION for row in rows.values())
    losses = []
    for m, xm in ((fast, x), (model, x), (exact, x.double())):
        loss = m(xm).double().square().mean()
        loss.backward()
        losses.append(loss.detach())
    rtol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(losses[0], losses[2], rtol=rtol, atol=0)
    eager, truth = dict(model.named_parameters()), dict(exact.named_parameters())
    for k, p in fast.named_parameters():
        g = truth[k].grad
        ours, theirs = (p.grad.double() - g).norm(), (eager[k].grad.double() - g).norm()
        # Within 4x the original's own error in its dtype, plus 0.2% of the gradient's norm (see
        # test_conv_batch_norm.test_optimize_training_step_cuda for why).
        assert ours <= 4 * theirs + 2e-3 * g.norm(), f"{k}: off by {ours:.2e}, torch's by {theirs:.2e}"


class _TailBlock(torch.nn.Module):
    """A training tail whose BatchNorm output is also returned (a feature for a second loss)."""

    def __init__(self, relu=torch.nn.ReLU):
        super().__init__()
        self.conv, self.bn, self.relu = torch.nn.Conv2d(4, 4, 3, padding=1), torch.nn.BatchNorm2d(4), relu()

    def forward(self, x):
        y = self.bn(self.conv(x))
        return self.relu(y + x), y


def test_a_batch_norm_read_twice_is_no_tail(tails_everywhere):
    model = torch.nn.Sequential(_TailBlock()).train()
    fast, report = opforge.optimize(copy.deepcopy(model), report=True)
    assert not tails(report)
    x = torch.randn(2, 4, 8, 8)
    for got, want in zip(fast(x), model(x)):
        torch.testing.assert_close(got, want)


def test_a_subclass_of_relu_ends_a_tail(tails_everywhere):
    """A ReLU subclass that keeps ReLU's forward is a ReLU: the tail is fused with it."""

    class MyReLU(torch.nn.ReLU):
        pass

    class Block(_TailBlock):
        def forward(self, x):
            return self.relu(self.bn(self.conv(x)) + x)

    model = torch.nn.Sequential(Block(MyReLU)).train().double()
    fast, report = opforge.optimize(copy.deepcopy(model), report=True)
    assert [row.action for row in tails(report).values()] == [TAIL_ACTION.replace("ReLU", "MyReLU")]
    x = torch.randn(2, 4, 8, 8, dtype=torch.float64)
    assert torch.equal(step(fast, x), step(model, x))


def test_a_shortcut_of_another_shape_or_dtype_trains(tails_everywhere):
    """``relu(bn(conv(x)) + offset)`` with a broadcast parameter, or a shortcut of a wider dtype: the tail
    is fused and the fused layer adds what the op does not take as the modules do."""

    class Block(_TailBlock):
        def __init__(self):
            super().__init__()
            self.offset = torch.nn.Parameter(torch.randn(1, 4, 1, 1, dtype=torch.float64))
            self.conv2, self.bn2 = torch.nn.Conv2d(4, 4, 3, padding=1), torch.nn.BatchNorm2d(4)

        def forward(self, x):
            return self.relu(self.bn(self.conv(x)) + self.offset) + self.relu(self.bn2(self.conv2(x)) + x.double())

    model = torch.nn.Sequential(Block()).train()
    fast, report = opforge.optimize(copy.deepcopy(model), report=True)
    assert len(tails(report)) == 2
    x = torch.randn(2, 4, 8, 8)
    torch.testing.assert_close(step(fast, x), step(model, x))
    for (key, a), b in zip(fast.state_dict().items(), model.state_dict().values()):
        torch.testing.assert_close(a, b, msg=key)
