"""opforge.conv2d_batch_norm and nn.ConvBatchNorm2d: training-mode conv -> BatchNorm -> activation in one call.

Where the op runs torch's own kernels (float64 on the CPU) every output,
gradient and running statistic must equal the three modules' bit for bit;
on opforge's own batch norm engines (float32 and the half types on the CPU,
channels_last on CUDA) within a rounding. tests/test_batch_norm_act_cpu.py
checks the CPU engine against float64."""

import copy
import re

import pytest
import torch
from reference import poisoned, randomize_batchnorm, saved_and_loaded
from training_models import step, train_model

import opforge
from opforge import optimize_layout
from opforge.ops.conv_batch_norm import why_not_own_engine

torchvision = pytest.importorskip("torchvision")

ACTIVATIONS = {None: torch.nn.Identity, "relu": torch.nn.ReLU, "relu6": torch.nn.ReLU6, "hardswish": torch.nn.Hardswish}
ACTIVATIONS["silu"] = torch.nn.SiLU


def modules(dtype, device, activation="relu", kernel=3, stride=1, padding=1, dilation=1, groups=1, bias=False, **bn):
    conv = torch.nn.Conv2d(8, 16, kernel, stride, padding, dilation, groups, bias=bias)
    block = torch.nn.Sequential(conv, torch.nn.BatchNorm2d(16, **bn), ACTIVATIONS[activation]())
    with torch.no_grad():
        randomize_batchnorm(block) if bn.get("affine", True) and bn.get("track_running_stats", True) else None
    return block.to(device, dtype).train()


def call_op(block, x, activation):
    conv, bn = block[0], block[1]
    return opforge.conv2d_batch_norm(
        x,
        conv.weight,
        conv.bias,
        bn.weight,
        bn.bias,
        bn.running_mean,
        bn.running_var,
        bn.num_batches_tracked,
        conv.stride,
        conv.padding,
        conv.dilation,
        conv.groups,
        bn.momentum,
        bn.eps,
        activation,
    )


# Where each activation's derivative jumps.
JUMPS = {"relu": (0.0,), "relu6": (0.0, 6.0), "hardswish": (-3.0, 3.0)}


def away_from_jumps(block, x, activation, width=None):
    """1 where block's pre-activation lies more than ``width`` (default 4 ulps of its dtype) from a
    point where the activation's derivative jumps, else 0. Two correct engines may round the
    pre-activation an ulp apart, which at such a point flips the derivative: a gradient of 0 there
    keeps the comparison to what is well defined."""
    with torch.no_grad():
        z = copy.deepcopy(block)[:2](x).float()
    keep = torch.ones_like(z, dtype=torch.bool)
    eps = torch.finfo(x.dtype).eps
    for point in JUMPS.get(activation, ()):
        keep &= (z - point).abs() > (width if width is not None else 4 * eps * max(abs(point), 1.0))
    return keep.to(x.dtype)


def compare(block, activation, x, device, exact):
    """The op on a copy of block against block itself: output, every gradient, the running statistics.
    exact=False (another engine than the modules'): the gradient is zero next to the activation's jumps."""
    mine = copy.deepcopy(block)
    grad_mask = 1 if exact else away_from_jumps(block, x, activation)
    with torch.no_grad():
        layout = copy.deepcopy(block)(x).stride()  # the modules' output layout on x's device
    if x.is_cuda and x.dtype == torch.float64:
        # The values from the modules on the CPU: torch's CUDA hardswish scales by a float 1/6
        # (3e-8 relative error).
        block = copy.deepcopy(block).cpu()
    x1 = x.detach().to(next(block.parameters()).device, copy=True).requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    ref = block(x1)
    out = call_op(mine, x2, activation)
    grad = torch.randn_like(out) * grad_mask
    ref.backward(grad.to(ref.device))
    out.backward(grad)
    pairs = [(out, ref), (x2.grad, x1.grad)]
    pairs += [(p.grad, q.grad) for p, q in zip(mine.parameters(), block.parameters())]
    pairs += [(p, q) for p, q in zip(mine.buffers(), block.buffers())]
    # A conv bias's gradient before a training BatchNorm is 0 in exact arithmetic: rounding noise
    # summed over the batch, of the size of the conv weight's gradient (a sum over as many values).
    noise = {id(block[0].bias.grad): block[0].weight.grad.abs().max().item()} if block[0].bias is not None else {}
    for actual, expected in pairs:
        assert (actual is None) == (expected is None)
        if actual is None:
            continue
        actual = actual.to(expected.device)
        if exact:
            assert torch.equal(actual, expected)
        else:
            rtol = {torch.float32: 1e-4, torch.float64: 1e-10}.get(actual.dtype, 2e-2)
            # A floor of 1 (the data's scale): a running mean that starts at 0 is rounding noise
            # around zero.
            scale = max(expected.abs().max().item(), 1.0, noise.get(id(expected), 0.0))
            torch.testing.assert_close(actual, expected, rtol=0, atol=rtol * scale)
    assert out.stride() == layout
    return mine


@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("channels_last", [False, True])
def test_op_equals_modules(device, activation, dtype, channels_last):
    block = modules(dtype, device, activation, bias=activation == "relu")
    x = torch.randn(4, 8, 12, 10, dtype=dtype, device=device)
    if channels_last:
        block = block.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    mine = compare(block, activation, x, device, exact=device == "cpu" and dtype == torch.float64)
    assert int(mine[1].num_batches_tracked) == 1


def engine_cases():
    """(channels, dtype, BatchNorm options, activation): channel counts that take 16-byte, 8-byte and
    one-element accesses and more than one block of channels; every BatchNorm variant; parameters in
    float32 under a half input."""
    bns = [dict(), dict(affine=False), dict(track_running_stats=False), dict(float_params=True)]
    cases = []
    for channels in (7, 20, 96, 2304):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for i, bn in enumerate(bns):
                if dtype == torch.float32 and bn.get("float_params"):
                    continue  # the same as the default
                activation = list(ACTIVATIONS)[(i + channels) % len(ACTIVATIONS)]
                cases.append((channels, dtype, bn, activation))
    return cases


@pytest.mark.cuda
@pytest.mark.parametrize("channels, dtype, bn, activation", engine_cases())
def test_cuda_engine(channels, dtype, bn, activation):
    """opforge's own CUDA batch norm (channels_last), every output poisoned first."""
    bn = dict(bn)
    float_params = bn.pop("float_params", False)
    conv = torch.nn.Conv2d(8, channels, 3, padding=1, bias=False)
    block = torch.nn.Sequential(conv, torch.nn.BatchNorm2d(channels, **bn), ACTIVATIONS[activation]())
    with torch.no_grad():
        if bn.get("affine", True) and bn.get("track_running_stats", True):
            randomize_batchnorm(block)
    block = block.cuda().train().to(memory_format=torch.channels_last)
    block[0].to(dtype)
    block[1].to(torch.float32 if float_params else dtype)
    x = torch.randn(8, 8, 33, 31, device="cuda", dtype=dtype).contiguous(memory_format=torch.channels_last)
    with poisoned("cuda"):
        compare(block, activation, x, "cuda", exact=False)


@pytest.mark.cuda
@pytest.mark.parametrize("activation", ["relu6", "hardswish"])
def test_cuda_engine_many_rows_far_from_zero(activation, monkeypatch):
    """Half a million rows per channel around a mean of 40 (the variance's sums must not cancel), a
    gradient in another memory format than the output, and the same bits from two runs (cuDNN's
    deterministic algorithms); against float64, the conv in full float32 (no TF32)."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    block = modules(torch.float32, "cuda", activation, bias=True).to(memory_format=torch.channels_last)
    with torch.no_grad():
        block[0].bias.fill_(40.0)
    x = torch.randn(32, 8, 128, 128, device="cuda").contiguous(memory_format=torch.channels_last)
    # NCHW: copied to the output's layout. Against float64 the pre-activation is off by the conv's
    # float32 rounding of values near 40 (about 1e-5), not by an ulp of itself.
    grad = torch.randn(32, 16, 128, 128, device="cuda") * away_from_jumps(block, x, activation, width=1e-3)
    results = []
    for _ in range(2):
        mine = copy.deepcopy(block)
        xi = x.clone().requires_grad_()
        out = call_op(mine, xi, activation)
        out.backward(grad)
        results.append((out, xi.grad, mine[1].weight.grad, mine[1].running_var))
    ref_x = x.double().requires_grad_()
    ref_block = copy.deepcopy(block).double()
    ref = ref_block(ref_x)
    ref.backward(grad.double())
    for a, b in zip(results[0], results[1]):
        assert torch.equal(a, b)
    out, x_grad, w_grad, running_var = results[0]
    for actual, expected in [(out, ref), (x_grad, ref_x.grad), (w_grad, ref_block[1].weight.grad)]:
        scale = max(expected.abs().max().item(), 1.0)
        torch.testing.assert_close(actual.double(), expected, rtol=0, atol=1e-4 * scale)
    torch.testing.assert_close(running_var.double(), ref_block[1].running_var, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    "conv",
    [
        dict(kernel=3, stride=2, padding=1),
        dict(kernel=3, groups=8, padding=1),
        dict(kernel=1, padding=0, bias=True),
        dict(kernel=5, padding=2, dilation=1),
        dict(kernel=3, padding=2, dilation=2),
        dict(kernel=3, stride=(2, 1), padding=(1, 0)),
    ],
)
def test_conv_shapes(device, conv):
    block = modules(torch.float32, device, "relu6", **conv)
    compare(block, "relu6", torch.randn(3, 8, 11, 13, device=device), device, exact=False)


@pytest.mark.parametrize("bn", [dict(affine=False), dict(track_running_stats=False), dict(momentum=0.3, eps=1e-3)])
def test_batch_norm_variants(device, bn):
    block = modules(torch.float32, device, "silu", **bn)
    compare(block, "silu", torch.randn(2, 8, 9, 9, device=device), device, exact=False)


class Doubled(torch.nn.Module):
    def forward(self, w):
        return 2 * w


@pytest.mark.parametrize(
    "bn, parametrized",
    [(dict(), False), (dict(affine=False), False), (dict(track_running_stats=False), False), (dict(), True)],
)
@pytest.mark.parametrize("training", [True, False])
def test_module_reads_its_tensors_as_the_modules_do(bn, parametrized, training):
    """ConvBatchNorm2d reads each tensor from its registry, or as an attribute where a parametrization
    computes it: output, gradients and running statistics are the three modules' (bit for bit in eval
    mode, where the modules run; in training within the own engine's rounding)."""
    block = modules(torch.float32, "cpu", "relu", **bn).train(training)
    mine = copy.deepcopy(block)
    fused = opforge.nn.ConvBatchNorm2d.of(mine[0], opforge.nn.BatchNormInConv.of(mine[1]), "relu")
    if parametrized:
        torch.nn.utils.parametrize.register_parametrization(block[0], "weight", Doubled())
        torch.nn.utils.parametrize.register_parametrization(fused, "weight", Doubled())
    x = torch.randn(2, 8, 7, 7)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, ref = fused(x1), block(x2)

    def same(a, b, msg=None):
        if training or not bn.get("track_running_stats", True):  # batch statistics: the own engine
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=msg)
        else:
            assert torch.equal(a, b), msg

    same(out, ref)
    out.square().sum().backward()
    ref.square().sum().backward()
    same(x1.grad, x2.grad)
    for (k, a), b in zip(mine[1].state_dict().items(), block[1].state_dict().values()):
        same(a, b, k)  # the running statistics the op updates


def test_gradcheck_float64():
    x = torch.randn(2, 3, 5, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 3, 3, 3, dtype=torch.float64, requires_grad=True)
    b, g, beta = (torch.randn(4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    for activation in ACTIVATIONS:
        # No running statistics: each call of gradcheck's would update them.
        def fn(x, w, b, g, beta, activation=activation):
            return opforge.conv2d_batch_norm(x, w, b, g, beta, None, None, padding=1, activation=activation)

        assert torch.autograd.gradcheck(fn, (x, w, b, g, beta))


@pytest.mark.parametrize("activation", ["relu", "silu", None])
def test_opcheck(device, activation):
    """Schema (the running statistics' mutation), autograd registration, fake tensors, AOT dispatch."""
    x = torch.randn(2, 3, 6, 6, device=device, requires_grad=True)
    w = torch.randn(4, 3, 3, 3, device=device, requires_grad=True)
    g, b = (torch.randn(4, device=device, requires_grad=True) for _ in range(2))
    stats = (torch.zeros(4, device=device), torch.ones(4, device=device), torch.tensor(0, device=device))
    args = (x, w, None, g, b, *stats, [1, 1], [1, 1], [1, 1], 1, 0.1, 1e-5, activation)
    torch.library.opcheck(torch.ops.opforge.conv2d_batch_norm.default, args)


def test_without_graph_updates_statistics():
    block = modules(torch.float32, "cpu", "relu")
    x = torch.randn(4, 8, 6, 6)
    ref = copy.deepcopy(block)
    for context in (torch.no_grad, torch.inference_mode):
        with context():
            out = call_op(block, x, "relu")
            expected = ref(x)
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(block[1].running_mean, ref[1].running_mean, rtol=1e-5, atol=1e-6)
        assert torch.equal(block[1].num_batches_tracked, ref[1].num_batches_tracked)


def test_empty_batch_matches_modules():
    block = modules(torch.float32, "cpu", "relu")
    x = torch.randn(0, 8, 6, 6)
    ref = copy.deepcopy(block)
    assert torch.equal(call_op(block, x, "relu"), ref(x))
    assert torch.equal(block[1].running_mean, ref[1].running_mean)


def test_bad_arguments_name_them():
    block = modules(torch.float32, "cpu", "relu")
    conv, bn = block[0], block[1]
    x = torch.randn(2, 8, 6, 6)
    op = opforge.conv2d_batch_norm
    with pytest.raises(RuntimeError, match="x must be a 4-d"):
        op(x[0], conv.weight, None, bn.weight, bn.bias, bn.running_mean, bn.running_var, padding=1)
    with pytest.raises(TypeError, match="same dtype"):
        op(x.double(), conv.weight, None, bn.weight, bn.bias, bn.running_mean, bn.running_var)
    with pytest.raises(RuntimeError, match="bn_weight must have shape \\[16\\]"):
        op(x, conv.weight, None, bn.weight[:3], bn.bias, bn.running_mean, bn.running_var)
    with pytest.raises(ValueError, match="running_mean and running_var"):
        op(x, conv.weight, None, bn.weight, bn.bias, bn.running_mean, None)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        op(x[:1, :, :3, :3], conv.weight, None, bn.weight, bn.bias, None, None)
    with pytest.raises(ValueError, match="activation must be"):
        op(x, conv.weight, None, bn.weight, bn.bias, None, None, activation="gelu")
    with pytest.raises(ValueError, match="stride must be an int or a pair"):
        op(x, conv.weight, None, bn.weight, bn.bias, None, None, stride=[1, 1, 1])


# ------------------------------------------------------------------ optimize in training mode


@pytest.mark.parametrize("name", ["mobilenet_v2", "mobilenet_v3_large", "resnet18"])
def test_optimize_training_step_equals_original(name):
    # Without example_inputs every chain gets the op, untimed: on the CPU its own engine (float32).
    model = train_model(name)
    x = torch.randn(2, 3, 64, 64)
    fast, report = opforge.optimize(model, report=True)
    fused = [m for m in fast.modules() if isinstance(m, opforge.nn.ConvBatchNorm2d)]
    chains = sum(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())
    assert len(fused) == chains  # every BatchNorm of these models follows a conv
    assert sum("as one op" in layer.action for layer in report.layers) == len(fused)
    assert len(report.replaced) == len(fused)
    n = len(report.layers)
    assert str(report).endswith(f"{len(fused)} of {n} layers changed, {n - len(fused)} left")
    assert list(fast.state_dict()) == list(model.state_dict())
    # The first loss within float32's rounding; after an SGD step the BatchNorms over few values per
    # channel make the loss ill-conditioned (both float32 runs move ~1e-2 from float64 on
    # mobilenet_v2), so the weights after one step are compared, not a second loss.
    torch.testing.assert_close(step(fast, x), step(model, x), rtol=1e-5, atol=1e-7)
    for (k, a), b in zip(fast.state_dict().items(), model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("name", ["mobilenet_v2", "resnet18"])
def test_timed_training_chains_where_the_op_runs_aten(name):
    """With example_inputs, a chain whose conv output opforge's own engine would not take (here,
    float64) never becomes the batch norm op, which would run the modules' kernels behind one more
    call: its BatchNorm and activation stay modules, and its conv alone becomes opforge's layer
    (no activation fused) only where that timed faster forward and backward."""
    model = train_model(name).double()
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    fast, report = opforge.optimize(model, example_inputs=(x,), report=True)
    assert not any(isinstance(m, opforge.nn.ConvBatchNorm2d) for m in fast.modules())

    def batch_norms(m):
        return [t for t in m.modules() if isinstance(t, torch.nn.BatchNorm2d)]

    assert len(batch_norms(fast)) == len(batch_norms(model))
    chains = [layer for layer in report.layers if "BatchNorm2d" in layer.pattern]
    assert len(chains) == len(batch_norms(model))
    for layer in chains:
        assert "would run ATen's kernels here (float64)" in layer.reason, layer
        conv = fast.get_submodule(layer.conv)
        if layer.action == "left":
            assert type(conv) is torch.nn.Conv2d, layer
            assert "the conv alone" in layer.reason or "no kernel for this conv" in layer.reason, layer
        else:
            assert re.fullmatch(r"opforge conv2d_(3x3|1x1) \(BatchNorm2d( and \w+)? kept\)", layer.action), layer
            assert isinstance(conv, (opforge.nn.Conv2d3x3, opforge.nn.Conv2d1x1)) and conv.activation is None
            assert "the conv alone: measured" in layer.reason, layer
    # The timing on example_inputs leaves no gradient behind, and names are the original's.
    assert all(p.grad is None for p in fast.parameters())
    assert list(fast.state_dict()) == list(model.state_dict())
    if optimize_layout.has_channels_last_hooks(fast):  # NCHW measured slower: then the same layout
        optimize_layout.install_channels_last(model)
    # opforge's convs sum in their own order. In float64 the two train alike to rounding. In
    # float32 the first step's loss agrees; after one SGD step on this small input, whose
    # BatchNorms see a few values per channel, both float32 runs are some 1e-5 from float64 and
    # from each other (which layers are replaced is a timing), so only float64 is compared there.
    fast64, model64 = copy.deepcopy(fast).double(), copy.deepcopy(model).double()
    torch.testing.assert_close(step(fast, x), step(model, x))
    for _ in range(2):
        torch.testing.assert_close(step(fast64, x.double()), step(model64, x.double()), rtol=1e-10, atol=1e-10)
    for (k, a), b in zip(fast64.state_dict().items(), model64.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=lambda m, k=k: f"{k}: {m}")


def test_why_not_own_engine_names_the_reason():
    bn = torch.nn.BatchNorm2d(4)
    y = torch.randn(2, 4, 3, 3)
    cl = y.contiguous(memory_format=torch.channels_last)
    # The CPU engine takes NCHW and channels_last, float32 and the half types.
    assert why_not_own_engine(y, bn) == ""
    assert why_not_own_engine(cl, bn) == ""
    assert why_not_own_engine(y.bfloat16(), bn) == ""  # float32 BatchNorm tensors with a half-type output
    assert why_not_own_engine(cl.half(), copy.deepcopy(bn).half()) == ""
    assert why_not_own_engine(y.double(), copy.deepcopy(bn).double()) == "float64"
    assert why_not_own_engine(y[:1, :, :1, :1].contiguous(), bn) == "one value per channel"
    assert why_not_own_engine(y[:, :, ::2], bn) == "a conv output neither NCHW nor channels_last"
    assert why_not_own_engine(y.half(), copy.deepcopy(bn).double()) == "BatchNorm tensors of another dtype or device"


@pytest.mark.cuda
def test_why_not_own_engine_on_cuda():
    bn = torch.nn.BatchNorm2d(4).cuda()
    y = torch.randn(2, 4, 3, 3, device="cuda")
    cl = y.contiguous(memory_format=torch.channels_last)
    assert why_not_own_engine(cl, bn) == ""
    assert why_not_own_engine(cl.bfloat16(), bn) == ""  # float32 BatchNorm tensors with a half-type output
    assert why_not_own_engine(y, bn) == "an NCHW conv output"
    assert why_not_own_engine(cl.double(), copy.deepcopy(bn).double()) == "float64"
    assert why_not_own_engine(cl[:1, :, :1, :1], bn) == "one value per channel"
    assert why_not_own_engine(cl.half(), copy.deepcopy(bn).double()) == "BatchNorm tensors of another dtype or device"


def test_optimized_training_model_evaluates_as_original():
    model = train_model("mobilenet_v2")
    x = torch.randn(2, 3, 64, 64)
    fast = opforge.optimize(model)
    step(fast, x)
    step(model, x)
    fast.eval()
    model.eval()
    with torch.no_grad():  # the running statistics from one step of each engine: within a rounding
        torch.testing.assert_close(fast(x), model(x), rtol=1e-4, atol=1e-5)
    fast.train()
    fast.load_state_dict(model.state_dict())


def test_optimized_training_model_copies_saves_and_compiles():
    """64x64: at 32x32 layer4's training BatchNorm normalizes two values per channel (batch 2, 1x1),
    where the loss moves by up to 2% between any two roundings (torch.compile of the original too)."""
    model = train_model("resnet18")
    x = torch.randn(2, 3, 64, 64)
    fast = opforge.optimize(model)
    copied = copy.deepcopy(fast)
    loaded = saved_and_loaded(fast)
    # Each copy's conv reads its own copy's BatchNorm.
    assert copied.bn1 is copied.conv1.batch_norm and loaded.bn1 is loaded.conv1.batch_norm
    expected = step(model, x)
    for m in (copied, loaded):
        torch.testing.assert_close(step(m, x), expected, rtol=1e-4, atol=1e-6)
    compiled = torch.compile(opforge.optimize(train_model("resnet18")), fullgraph=True)
    torch.testing.assert_close(step(compiled, x), expected, rtol=1e-4, atol=1e-6)
    wide = opforge.optimize(train_model("resnet18")).to(torch.float64)
    assert wide.conv1.batch_norm.running_mean.dtype == torch.float64
    step(wide, x.double())


def test_left_alone_in_training():
    conv = torch.nn.Conv2d(4, 4, 3, padding=1, padding_mode="reflect")
    cumulative = torch.nn.Sequential(torch.nn.Conv2d(4, 4, 3), torch.nn.BatchNorm2d(4, momentum=None))
    for block, why in [
        (torch.nn.Sequential(conv, torch.nn.BatchNorm2d(4), torch.nn.ReLU()), "padding_mode"),
        (cumulative, "momentum=None"),
    ]:
        fast, report = opforge.optimize(block.train(), report=True)
        assert type(fast[0]) is torch.nn.Conv2d and type(fast[1]) is torch.nn.BatchNorm2d
        assert report.layers[0].action == "left" and why in report.layers[0].reason


def test_optimizing_again_keeps_the_pair():
    fast = opforge.optimize(train_model("mobilenet_v2"))
    again = opforge.optimize(fast)
    assert isinstance(again.features[0][0], opforge.nn.ConvBatchNorm2d)
    assert again.features[0][0].batch_norm is again.features[0][1]
    again.eval()
    assert isinstance(opforge.optimize(again).features[0][0], opforge.nn.ConvBatchNorm2d)


def test_autocast_runs_torch_path():
    block = modules(torch.float32, "cpu", "relu")
    fast = opforge.optimize(copy.deepcopy(block))
    x = torch.randn(2, 8, 6, 6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, ref = fast(x), block(x)
    assert out.dtype == ref.dtype
    assert torch.equal(out, ref)


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["mobilenet_v2", "resnet18"])
def test_optimize_training_step_cuda(name, monkeypatch):
    """A forward and backward of the optimized model (channels_last: opforge's own batch norm engine,
    which rounds apart from ATen's) and of the original, both float32, against the original in
    float64. Each gradient's error must be of the original's own float32 error: within 4x of it, plus
    0.2% of the gradient's norm. The slack covers what float32 cannot decide: pre-activations within
    an ulp of relu6's jumps, where an ulp apart flips that element's derivative (test_cuda_engine
    checks each layer elementwise away from the jumps), and gradients that are zero in exact
    arithmetic (a bias whose BatchNorm feeds another training BatchNorm), left as rounding noise.
    A wrong term in a backward is off by far more. Full float32 convs (no TF32) and deterministic
    cuDNN algorithms."""
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    model = train_model(name, "cuda").to(memory_format=torch.channels_last)
    exact = copy.deepcopy(model).double()
    x = torch.randn(4, 3, 64, 64, device="cuda").contiguous(memory_format=torch.channels_last)
    fast = opforge.optimize(model, example_inputs=(x,))
    assert any(isinstance(m, opforge.nn.ConvBatchNorm2d) and m.activation for m in fast.modules())
    losses = []
    for m, xm in ((fast, x), (model, x), (exact, x.double())):
        loss = m(xm).square().mean()
        loss.backward()
        losses.append(loss.detach().double())
    torch.testing.assert_close(losses[0], losses[2], rtol=1e-5, atol=0)
    torch.testing.assert_close(losses[1], losses[2], rtol=1e-5, atol=0)
    eager, truth = dict(model.named_parameters()), dict(exact.named_parameters())
    for k, p in fast.named_parameters():
        g = truth[k].grad
        ours, theirs = (p.grad.double() - g).norm(), (eager[k].grad.double() - g).norm()
        bound = 4 * theirs + 2e-3 * g.norm()
        assert ours <= bound, f"{k}: gradient off by {ours:.2e}, torch's float32 by {theirs:.2e} (norm {g.norm():.2e})"
    expected = exact.state_dict()
    assert fast.state_dict().keys() == expected.keys()
    for k, a in fast.state_dict().items():
        torch.testing.assert_close(a, expected[k].to(a.dtype), rtol=1e-4, atol=1e-6, msg=k)
