"""opforge.nn.PrepackedConv2d: oneDNN's CPU convolution with a prepacked weight and a fused activation."""

import copy

import pytest
import torch
import torch.nn.functional as F
from conv_bounds import TORCH_ACT
from reference import saved_and_loaded

import opforge
from opforge import nn_prepacked_ops
from opforge.nn_prepacked import onednn_runs

needs_onednn = pytest.mark.skipif(not onednn_runs(torch.float32), reason="this torch build has no oneDNN")
ACTIVATIONS = [None, "relu", "relu6", "hardswish", "silu"]


def reference(x, conv, activation):
    """act(conv(x)) in float64."""
    b = None if conv.bias is None else conv.bias.double()
    z = F.conv2d(x.double(), conv.weight.double(), b, conv.stride, conv.padding, conv.dilation, conv.groups)
    return TORCH_ACT[activation](z)


def tolerance(dtype, conv):
    # oneDNN's sums in float32 (bfloat16 inputs: float32 accumulation, one rounding of the output).
    terms = conv.weight[0].numel()
    return {torch.float32: 1e-6 * terms, torch.bfloat16: 1.6e-2}[dtype]


LAYERS = [
    dict(in_channels=8, out_channels=16, kernel_size=1),
    dict(in_channels=8, out_channels=16, kernel_size=3, padding=1),
    dict(in_channels=8, out_channels=8, kernel_size=3, stride=2, padding=1, groups=8),
    dict(in_channels=8, out_channels=16, kernel_size=3, padding=1, groups=8),  # channel multiplier 2
    dict(in_channels=8, out_channels=8, kernel_size=5, padding=2, groups=8),
    dict(in_channels=8, out_channels=12, kernel_size=3, padding=2, dilation=2, groups=2),
    dict(in_channels=3, out_channels=16, kernel_size=7, stride=2, padding=3, bias=False),
    dict(in_channels=8, out_channels=8, kernel_size=(1, 3), stride=(1, 2), padding=(0, 1)),
]


@needs_onednn
@pytest.mark.parametrize("layer", LAYERS, ids=lambda d: "-".join(f"{k[0]}{v}" for k, v in d.items()))
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_float64_conv_and_activation(layer, activation, channels_last, dtype):
    if not onednn_runs(dtype):
        pytest.skip(f"oneDNN does not run {dtype} on this CPU")
    conv = torch.nn.Conv2d(**layer).eval().to(dtype)
    x = torch.randn(2, layer["in_channels"], 13, 11, dtype=dtype)
    if channels_last:
        conv = conv.to(memory_format=torch.channels_last)
        x = x.to(memory_format=torch.channels_last)
    fast = opforge.nn.PrepackedConv2d.from_conv(conv, activation=activation)
    with torch.no_grad():
        out = fast(x)
    assert fast._packed is not None  # the oneDNN path ran, not the fallback
    ref = reference(x, conv, activation)
    assert out.dtype == dtype and out.shape == ref.shape
    with torch.no_grad():
        assert out.stride() == conv(x).stride()  # F.conv2d's memory format
    scale = ref.abs().max().item() + 1
    torch.testing.assert_close(out.double(), ref, atol=tolerance(dtype, conv) * scale, rtol=0)


@needs_onednn
def test_weight_changes_rebuild_the_packed_copy():
    conv = torch.nn.Conv2d(4, 6, 3, padding=1).eval()
    fast = opforge.nn.PrepackedConv2d.from_conv(conv, activation="relu")
    x = torch.randn(1, 4, 9, 9)

    def expected():
        return F.relu(F.conv2d(x, fast.weight, fast.bias, 1, 1))

    with torch.no_grad():
        fast(x)
        fast.weight.mul_(-2.0)  # in place: the version counter moves
        torch.testing.assert_close(fast(x), expected())
        other = torch.nn.Conv2d(4, 6, 3, padding=1)
        fast.load_state_dict(other.state_dict())
        torch.testing.assert_close(fast(x), expected())
        fast.weight = torch.nn.Parameter(torch.randn(6, 4, 3, 3))  # a new tensor
        torch.testing.assert_close(fast(x), expected())
        # another input size per sample: repacked for it
        x = torch.randn(3, 4, 17, 5)
        torch.testing.assert_close(fast(x), expected())


@needs_onednn
def test_changes_through_data_need_invalidate():
    conv = torch.nn.Conv2d(4, 6, 1).eval()
    fast = opforge.nn.PrepackedConv2d.from_conv(conv)
    x = torch.randn(1, 4, 5, 5)
    with torch.no_grad():
        fast(x)
        fast.weight.data.mul_(-1.0)  # .data has a version counter of its own
        fast.invalidate()
        torch.testing.assert_close(fast(x), F.conv2d(x, fast.weight, fast.bias))


@needs_onednn
def test_inference_mode_weights_take_torchs_conv():
    with torch.inference_mode():
        conv = torch.nn.Conv2d(4, 6, 3, padding=1).eval()
        fast = opforge.nn.PrepackedConv2d.from_conv(conv, activation="relu")
        x = torch.randn(1, 4, 7, 7)
        torch.testing.assert_close(fast(x), F.relu(conv(x)))
    assert fast._packed is None  # no version counter to see changes by: the fallback


@needs_onednn
def test_copy_pickle_and_state_dict():
    conv = torch.nn.Conv2d(4, 6, 1).eval()
    fast = opforge.nn.PrepackedConv2d.from_conv(conv, activation="silu")
    x = torch.randn(2, 4, 5, 5)
    with torch.no_grad():
        out = fast(x)
        assert fast._packed is not None
        torch.testing.assert_close(copy.deepcopy(fast)(x), out)
        torch.testing.assert_close(saved_and_loaded(fast)(x), out)
    assert set(fast.state_dict()) == set(conv.state_dict()) == {"weight", "bias"}
    plain = torch.nn.Conv2d(4, 6, 1)
    plain.load_state_dict(fast.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(F.silu(plain(x)), out)


def test_training_runs_torchs_conv_and_its_gradients():
    conv = torch.nn.Conv2d(4, 6, 3, padding=1)
    fast = opforge.nn.PrepackedConv2d.from_conv(conv, activation="hardswish")
    x = torch.randn(2, 4, 7, 7, requires_grad=True)
    fast(x).square().sum().backward()
    x2 = x.detach().clone().requires_grad_()
    F.hardswish(conv(x2)).square().sum().backward()
    assert fast._packed is None  # a recorded graph takes F.conv2d
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(fast.weight.grad, conv.weight.grad)
    torch.testing.assert_close(fast.bias.grad, conv.bias.grad)


@needs_onednn
def test_parametrized_weight_and_no_bias():
    """A weight computed by a parametrization (not in the parameter registry) and no bias: the
    per-call reads find both, and each call sees the weight's current value."""
    conv = torch.nn.Conv2d(4, 6, 3, padding=1, bias=False).eval()
    fast = opforge.nn.PrepackedConv2d.from_conv(conv, activation="relu").eval()
    torch.nn.utils.parametrize.register_parametrization(fast, "weight", Doubled())
    x = torch.randn(2, 4, 7, 7)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), F.relu(F.conv2d(x, 2 * conv.weight, padding=1)))
        fast.parametrizations.weight.original.mul_(-1)
        torch.testing.assert_close(fast(x), F.relu(F.conv2d(x, -2 * conv.weight, padding=1)))


class Doubled(torch.nn.Module):
    def forward(self, w):
        return 2 * w


def test_float64_and_unbatched_inputs_take_torchs_conv():
    conv = torch.nn.Conv2d(4, 6, 3, padding=1).double().eval()
    fast = opforge.nn.PrepackedConv2d.from_conv(conv, activation="relu6")
    with torch.no_grad():
        for x in (torch.randn(2, 4, 6, 6, dtype=torch.float64), torch.randn(4, 6, 6, dtype=torch.float64)):
            torch.testing.assert_close(fast(x), F.relu6(conv(x)))
    assert fast._packed is None


@needs_onednn
def test_empty_batch():
    fast = opforge.nn.PrepackedConv2d(4, 6, 3, padding=1, activation="relu").eval()
    with torch.no_grad():
        out = fast(torch.randn(0, 4, 6, 6))
    assert fast._packed is not None and out.shape == (0, 6, 6, 6)


def _traced_ops(module, *args):
    """The call_function targets torch.compile traces for ``module(*args)``, and the output."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(module, backend=capture, fullgraph=True)(*args)
    return " ".join(str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"), out


@needs_onednn
@pytest.mark.parametrize("channels_last", [False, True])
def test_compile_keeps_the_onednn_call_and_its_cache(channels_last):
    fast = opforge.nn.PrepackedConv2d(4, 6, 3, padding=1, activation="relu").eval()
    x = torch.randn(2, 4, 8, 8)
    x = x.contiguous(memory_format=torch.channels_last) if channels_last else x
    with torch.no_grad():
        traced, out = _traced_ops(fast, x)
        expected = F.relu(F.conv2d(x, fast.weight, fast.bias, 1, 1))
        assert "opforge.onednn_conv" in traced and "conv2d" not in traced, traced
        torch.testing.assert_close(out, expected)
        assert out.stride() == expected.stride()
        assert fast._packed is not None  # the compiled call filled the weight's cache
        # A change to the weight after compiling is seen: the cache is keyed by its version.
        compiled = torch.compile(fast, fullgraph=True)
        compiled(x)
        fast.weight.mul_(-1)
        torch.testing.assert_close(compiled(x), F.relu(F.conv2d(x, fast.weight, fast.bias, 1, 1)))


def test_compile_with_grad_and_export_trace_torchs_conv():
    fast = opforge.nn.PrepackedConv2d(4, 6, 3, padding=1, activation="relu").eval()
    x = torch.randn(1, 4, 8, 8)
    traced, out = _traced_ops(fast, x)  # gradients recorded: the fused call has no backward
    assert "conv2d" in traced and "onednn" not in traced, traced
    with torch.no_grad():
        exported = torch.export.export(fast, (x,))
    ops = " ".join(str(n.target) for n in exported.graph.nodes if n.op == "call_function")
    assert "conv2d" in ops and "onednn" not in ops, ops


@needs_onednn
def test_compiled_layers_share_one_graph_and_pack_once(monkeypatch):
    """Identical layers compiled one by one reuse one graph (nothing per layer is a constant in it),
    and each weight is reordered once, not per call."""
    from opforge import nn_prepacked_ops

    packs = []
    real_pack = nn_prepacked_ops.pack
    monkeypatch.setattr(nn_prepacked_ops, "pack", lambda *a: packs.append(1) or real_pack(*a))
    layers = [opforge.nn.PrepackedConv2d(4, 4, 3, padding=1, activation="relu").eval() for _ in range(12)]
    x = torch.randn(1, 4, 8, 8)
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()
    with torch.no_grad():
        for layer in layers:
            compiled = torch.compile(layer, backend=counter)
            for _ in range(3):
                torch.testing.assert_close(compiled(x), F.relu(F.conv2d(x, layer.weight, layer.bias, 1, 1)))
    assert counter.frame_count == 1
    assert len(packs) == len(layers)


@needs_onednn
@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (1, 3, 5, 5), (3, 8, 1, 1)])
@pytest.mark.parametrize("channels_last", [False, True])
def test_onednn_op_meets_its_fake(shape, channels_last):
    """torch.library.opcheck: the fake's shape and strides are the real output's, size-1 dims too."""
    from opforge import nn_prepacked_ops  # noqa: F401 - defines the op

    x = torch.randn(shape)
    x = x.contiguous(memory_format=torch.channels_last) if channels_last else x
    w = torch.randn(4, shape[1], 1, 1)
    for residual in (None, torch.randn(shape[0], 4, *shape[2:])):
        args = (x, w, torch.randn(4), residual, [1, 1], [0, 0], [1, 1], 1, "relu")
        torch.library.opcheck(torch.ops.opforge.onednn_conv.default, args, test_utils=("test_faketensor",))


@needs_onednn
def test_compiled_onednn_residual_tail():
    conv = torch.nn.Conv2d(8, 8, 3, padding=1).eval()
    tail = opforge.nn.ConvResidual.from_conv(conv, activation="relu", engine="onednn")
    x, r = torch.randn(2, 8, 6, 6), torch.randn(2, 8, 6, 6)
    with torch.no_grad():
        traced, out = _traced_ops(tail, x, r)
        assert "opforge.onednn_conv" in traced, traced
        torch.testing.assert_close(out, F.relu(conv(x) + r))
        compiled = torch.compile(tail, fullgraph=True)
        torch.testing.assert_close(compiled(x, r), F.relu(conv(x) + r))


@needs_onednn
def test_autocast_runs_torchs_conv():
    fast = opforge.nn.PrepackedConv2d(4, 6, 3, padding=1, activation="relu").eval()
    x = torch.randn(1, 4, 8, 8)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        eager, compiled = fast(x), torch.compile(fast)(x)
        expected = F.relu(F.conv2d(x, fast.weight, fast.bias, 1, 1))
    assert eager.dtype == compiled.dtype == expected.dtype == torch.bfloat16


def test_bad_arguments():
    for bad in ("gelu", "", "none"):
        with pytest.raises(ValueError, match="activation must be None, 'relu'"):
            opforge.nn.PrepackedConv2d(4, 4, 3, activation=bad)
    with pytest.raises(ValueError, match="padding must be an int or a pair"):
        opforge.nn.PrepackedConv2d(4, 4, 3, padding="same")
    with pytest.raises(TypeError, match="conv must be a torch.nn.Conv2d"):
        opforge.nn.PrepackedConv2d.from_conv(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="padding_mode 'reflect'"):
        opforge.nn.PrepackedConv2d.from_conv(torch.nn.Conv2d(4, 4, 3, padding=1, padding_mode="reflect"))
    with pytest.raises(ValueError, match="zero padding of a size both sides share"):
        opforge.nn.PrepackedConv2d.from_conv(torch.nn.Conv2d(4, 4, 2, padding="same"))
    # "same" with an odd kernel is an explicit padding
    layer = opforge.nn.PrepackedConv2d.from_conv(torch.nn.Conv2d(4, 4, 3, padding="same"))
    assert layer.padding == (1, 1)


@pytest.mark.cuda
@pytest.mark.parametrize("activation", [None, "relu6", "silu"])
def test_cuda_runs_torchs_conv_for_other_activations(activation):
    conv = torch.nn.Conv2d(4, 6, 3, padding=1).cuda().eval()
    fast = opforge.nn.PrepackedConv2d.from_conv(conv, activation=activation)
    x = torch.randn(2, 4, 9, 9, device="cuda")
    with torch.no_grad():
        assert not fast._cudnn_path(x, *fast._weight_bias())
        torch.testing.assert_close(fast(x), TORCH_ACT[activation](conv(x)))
    assert fast._packed is None


@pytest.mark.cuda
@pytest.mark.parametrize("layer", LAYERS, ids=lambda d: "-".join(f"{k[0]}{v}" for k, v in d.items()))
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_relu_runs_cudnns_fused_conv(layer, channels_last, dtype):
    conv = torch.nn.Conv2d(**layer).eval().to("cuda", dtype)
    x = torch.randn(2, layer["in_channels"], 13, 11, dtype=dtype, device="cuda")
    if channels_last:
        conv = conv.to(memory_format=torch.channels_last)
        x = x.to(memory_format=torch.channels_last)
    fast = opforge.nn.PrepackedConv2d.from_conv(conv, activation="relu")
    torch.backends.cudnn.allow_tf32 = False
    try:
        with torch.no_grad():
            assert fast._cudnn_path(x, *fast._weight_bias())
            out = fast(x)
            assert out.stride() == conv(x).stride()
    finally:
        torch.backends.cudnn.allow_tf32 = True
    ref = reference(x, conv, "relu")
    terms = conv.weight[0].numel()
    tol = {torch.float32: 1e-6 * terms, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(out.double(), ref, atol=tol * (ref.abs().max().item() + 1), rtol=0)
    # With a gradient recorded it is torch's conv, and trains as it does.
    x.requires_grad_()
    fast(x).float().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_channels_last_weight_is_copied_once_per_weight_version():
    weight = torch.nn.Parameter(torch.randn(6, 4, 3, 3))
    x = torch.randn(1, 4, 5, 5).to(memory_format=torch.channels_last)
    first = nn_prepacked_ops.channels_last_weight(x, weight)
    assert first.is_contiguous(memory_format=torch.channels_last) and not first.is_contiguous()
    assert torch.equal(first, weight) and not first.requires_grad
    assert nn_prepacked_ops.channels_last_weight(x, weight) is first
    assert weight.is_contiguous()  # the parameter keeps its format
    with torch.no_grad():
        weight.mul_(-2)  # an in-place change bumps the version: a new copy
    second = nn_prepacked_ops.channels_last_weight(x, weight)
    assert second is not first and torch.equal(second, weight)
    weight.data = torch.randn(6, 4, 3, 3)  # new data: a new copy
    assert torch.equal(nn_prepacked_ops.channels_last_weight(x, weight), weight)
    nn_prepacked_ops.drop(weight)
    assert nn_prepacked_ops.cached_channels_last(weight) is None
    # Nothing to copy: an NCHW input, a weight already in (or also in) channels_last, a 1x1 kernel.
    assert nn_prepacked_ops.channels_last_weight(x.contiguous(), weight) is weight
    cl = weight.detach().to(memory_format=torch.channels_last)
    assert nn_prepacked_ops.channels_last_weight(x, cl) is cl
    pointwise = torch.randn(6, 4, 1, 1)
    assert nn_prepacked_ops.channels_last_weight(x, pointwise) is pointwise
    with torch.inference_mode():
        frozen = torch.randn(6, 4, 3, 3)  # no version counter: never cached
    assert nn_prepacked_ops.channels_last_weight(x, frozen) is frozen


def test_weight_caches_let_go_of_a_weight_that_dies():
    """The caches are keyed by the weight's id: an entry must die with its weight, so that a new
    tensor that gets the same id never finds the old weight's copy."""
    x = torch.randn(1, 4, 5, 5).to(memory_format=torch.channels_last)
    caches = [nn_prepacked_ops._CHANNELS_LAST]
    weight = torch.nn.Parameter(torch.randn(6, 4, 3, 3))
    nn_prepacked_ops.channels_last_weight(x, weight)
    if onednn_runs(torch.float32):
        caches.append(nn_prepacked_ops._PACKED)
        nn_prepacked_ops.packed_weight(weight, x, (1, 1), (1, 1), (1, 1), 1)
        assert nn_prepacked_ops.cached(weight) is not None
    key = id(weight)
    assert all(key in cache._entries for cache in caches)
    del weight
    assert all(key not in cache._entries for cache in caches)
    # An entry whose weakref no longer points at the tensor asked about is not found.
    other = torch.nn.Parameter(torch.randn(6, 4, 3, 3))
    nn_prepacked_ops._CHANNELS_LAST._entries[id(other)] = (lambda: None, (other.data_ptr(), other._version, other))
    assert nn_prepacked_ops.cached_channels_last(other) is None
    assert nn_prepacked_ops.channels_last_weight(x, other) is not other


def test_a_layer_called_on_several_shapes_reorders_its_weight_once_per_shape(monkeypatch):
    """A head shared by the levels of a feature pyramid alternates input shapes: each shape's
    reordered weight is kept (a few per weight), not made again on every call; an in-place change
    of the weight drops them all."""
    if not onednn_runs(torch.float32):
        pytest.skip("oneDNN does not run here")
    made = []
    pack = nn_prepacked_ops.pack
    monkeypatch.setattr(nn_prepacked_ops, "pack", lambda *args: made.append(args[1].shape) or pack(*args))
    conv = torch.nn.Conv2d(4, 6, 3, padding=1).eval()
    layer = opforge.nn.PrepackedConv2d.from_conv(conv)
    shapes = [(1, 4, 16, 16), (1, 4, 8, 8), (1, 4, 4, 4)]
    with torch.no_grad():
        for _ in range(3):
            for shape in shapes:
                x = torch.randn(shape)
                torch.testing.assert_close(layer(x), conv(x), atol=1e-5, rtol=1e-5)
        assert made == [torch.Size(s) for s in shapes]
        for shape in [(1, 4, 5, 5), (1, 4, 6, 6), (1, 4, 16, 16)]:  # the oldest beyond four is dropped
            layer(torch.randn(shape))
        assert len(made) == 6
        layer.weight.mul_(2.0)
        x = torch.randn(shapes[0])
        torch.testing.assert_close(layer(x), torch.nn.functional.conv2d(x, layer.weight, layer.bias, padding=1))
    assert len(made) == 7


@pytest.mark.cuda
@pytest.mark.parametrize("activation", [None, "relu", "silu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_nchw_weight_with_channels_last_input_is_copied_once(activation, dtype):
    conv = torch.nn.Conv2d(8, 16, 3, padding=1).eval().to("cuda", dtype)
    fast = opforge.nn.PrepackedConv2d.from_conv(conv, activation=activation)
    x = torch.randn(2, 8, 13, 11, dtype=dtype, device="cuda").to(memory_format=torch.channels_last)
    tol = {torch.float32: 1e-6 * conv.weight[0].numel(), torch.bfloat16: 1.6e-2}[dtype]

    def check(out):
        ref = reference(x, conv, activation)
        torch.testing.assert_close(out.double(), ref, atol=tol * (ref.abs().max().item() + 1), rtol=0)

    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False), torch.no_grad():
        out = fast(x)
        copied = nn_prepacked_ops.cached_channels_last(fast.weight)
        assert copied is not None and copied.is_contiguous(memory_format=torch.channels_last)
        assert fast.weight.is_contiguous()  # the parameter keeps its format
        assert out.stride() == conv(x).stride()
        check(out)
        for w in (fast.weight, conv.weight):
            w.mul_(-1)  # the copy follows the weight
        check(fast(x))
        assert nn_prepacked_ops.cached_channels_last(fast.weight) is not copied
    # With a gradient recorded the parameter itself goes to the conv, and gets its gradient.
    fast(x).float().sum().backward()
    assert fast.weight.grad is not None and fast.weight.grad.shape == fast.weight.shape
