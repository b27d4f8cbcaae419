"""Whether opforge's conv2d_3x3 / conv2d_1x1 beats what it would replace, measured on the layer's own input.

The choice is a timing, not a rule of thumb: the layer as it stands (torch's
conv, then its activation module) against opforge's fused kernel, on the
input the layer sees, on its device, dtype and memory format, in the mode
(eval: forward; training: forward + backward) the model is in. Results are
cached per process by everything that decides the kernel's speed.

A second timing decides what the layer runs as under ``torch.compile``:
there inductor fuses a conv's bias and activation into one pointwise pass
(often into a neighbour's), so opforge's kernel is kept there only where it
beats the conv alone plus that one pass, on the GPU's own clock.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import time

import torch
import torch.nn.functional as F

from .nn import Conv2d1x1, Conv2d3x3
from .nn_prepacked import CUDNN_FUSED_DTYPES, PrepackedConv2d, explicit_padding, onednn_runs
from .nn_prepacked_ops import is_channels_last

_cache: dict[tuple, tuple[bool, str]] = {}
# opforge's kernel must be this much faster (3%) to replace torch's layers.
_MARGIN = 1.03


def _pair(v):
    return tuple(v) if isinstance(v, (tuple, list)) else (v, v)


@dataclasses.dataclass
class ConvCandidate:
    conv: torch.nn.Conv2d
    activation: str | None  # fused into the kernel: None, "relu", "relu6", "hardswish" or "silu"
    stride: int
    padding: int

    @classmethod
    def of(cls, conv: torch.nn.Conv2d, activation: str | None) -> ConvCandidate | None:
        """The conv as opforge could run it, or None where opforge has no kernel for it."""
        if conv.weight.dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
            return None
        stride = _pair(conv.stride)
        if stride[0] != stride[1]:
            return None
        if tuple(conv.kernel_size) == (1, 1):
            # No padding ("same" and "valid" are none for a 1x1 kernel); dilation does not apply.
            padding = (0, 0) if isinstance(conv.padding, str) else _pair(conv.padding)
            if conv.groups != 1 or padding != (0, 0):
                return None
            return cls(conv, activation, stride[0], 0)
        if tuple(conv.kernel_size) != (3, 3) or _pair(conv.dilation) != (1, 1) or conv.padding_mode != "zeros":
            return None
        padding = (1, 1) if conv.padding == "same" else (0, 0) if conv.padding == "valid" else _pair(conv.padding)
        if stride[0] not in (1, 2) or padding[0] != padding[1] or padding[0] not in (0, 1):
            return None
        if conv.groups not in (1, conv.in_channels) or (conv.groups > 1 and conv.out_channels % conv.groups):
            return None
        return cls(conv, activation, stride[0], padding[0])

    @property
    def op(self) -> str:
        """The opforge op that would run the layer."""
        return "conv2d_1x1" if tuple(self.conv.kernel_size) == (1, 1) else "conv2d_3x3"

    @property
    def label(self) -> str:
        return f"opforge {self.op}"

    def module(self) -> torch.nn.Module:
        """opforge's layer, with the conv's parameters (same values, dtype, device and memory format).

        In training mode the layer holds the conv's own Parameter objects, not copies: an
        optimizer built on the model before ``optimize(..., inplace=True)`` keeps stepping them,
        and parameters tied to other modules stay tied."""
        layer = (Conv2d1x1 if self.op == "conv2d_1x1" else Conv2d3x3).from_conv(self.conv, activation=self.activation)
        if self.conv.training:
            layer.weight = self.conv.weight
            if self.conv.bias is not None:
                layer.bias = self.conv.bias
        return layer


@dataclasses.dataclass
class PrepackedCandidate:
    """The conv as a PrepackedConv2d, for inference: on the CPU oneDNN with its weight reordered
    once and the activation as its post-op (any kernel size, stride, dilation and groups; zero
    padding); on CUDA, for a ReLU, cuDNN's fused convolution + bias + ReLU."""

    conv: torch.nn.Conv2d
    activation: str | None
    cuda: bool = False
    op = "prepacked"

    @property
    def label(self) -> str:
        return "cuDNN's fused conv" if self.cuda else "oneDNN conv with a prepacked weight"

    @classmethod
    def of(cls, conv: torch.nn.Conv2d, activation: str | None, x: torch.Tensor | None) -> PrepackedCandidate | None:
        if x is None or x.dim() != 4 or conv.training or x.dtype != conv.weight.dtype:
            return None
        if explicit_padding(conv) is None or conv.padding_mode != "zeros":
            return None
        if x.is_cuda:
            fused = activation == "relu" and x.dtype in CUDNN_FUSED_DTYPES and torch.backends.cudnn.is_available()
            return cls(conv, activation, cuda=True) if fused else None
        return cls(conv, activation) if x.device.type == "cpu" and onednn_runs(x.dtype) else None

    def module(self) -> torch.nn.Module:
        return PrepackedConv2d.from_conv(self.conv, activation=self.activation)


def _layout(x: torch.Tensor) -> str:
    return "cl" if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) else "nchw"


def _key(candidate: ConvCandidate | PrepackedCandidate, act: torch.nn.Module | None, x: torch.Tensor) -> tuple:
    """The candidate's op, then everything of the layer and its input that decides the speed."""
    c = candidate.conv
    return (
        candidate.op,
        str(x.device),
        x.dtype,
        _layout(x),
        tuple(x.shape),
        tuple(c.weight.shape),
        c.bias is not None,
        tuple(c.stride),
        str(c.padding),
        c.groups,
        tuple(c.dilation),
        type(act).__name__ if act is not None else None,
        c.training,
        c.weight.requires_grad,  # in training, whether the backward computes the weight's gradient
        is_channels_last(c.weight),
    )


# A timing sample runs ``calls`` calls, or fewer where one call takes over this / ``calls``: a slow
# layer (a wide conv on a CPU) is timed as steadily in a few calls, and optimize's wait stays short.
_SAMPLE_S = 0.005


def _median_us(
    fn, device: torch.device, calls: int = 20, repeats: int = 7, sample_s: float | None = _SAMPLE_S
) -> float:
    """fn's median time per call in us over ``repeats`` samples of ``calls`` calls each (fewer calls
    where a sample would take over ``sample_s``; None: always ``calls``), after one untimed call."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    if sample_s is not None:
        t0 = time.perf_counter()
        fn()
        sync()
        calls = max(1, min(calls, math.ceil(sample_s / max(time.perf_counter() - t0, 1e-9))))
    samples = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(samples)


def _gpu_us(fn, calls: int = 10, repeats: int = 5) -> float:
    """fn's GPU time per call: ``calls`` calls captured in one CUDA graph and replayed, so
    that the host's launch time, which compiled code mostly hides, is not counted."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(samples)


# The activations' one in-place pass, standing for the pointwise kernel inductor would write.
_INPLACE_ACTIVATIONS = {
    "relu": torch.relu_,
    "relu6": lambda t: F.hardtanh_(t, 0.0, 6.0),
    "hardswish": lambda t: F.hardswish(t, inplace=True),
    "silu": lambda t: F.silu(t, inplace=True),
}


def _compiled_times_us(theirs, ours, device: torch.device) -> tuple[float, float, str]:
    """Both sides on one clock: the GPU's where both capture into a CUDA graph, else the host's."""
    if device.type == "cuda":
        try:
            return _gpu_us(theirs), _gpu_us(ours), "GPU time"
        except RuntimeError:  # not capturable
            pass
    return _median_us(theirs, device), _median_us(ours, device), "measured"


def faster_under_compile(candidate: ConvCandidate, act: torch.nn.Module | None, x: torch.Tensor):
    """(opforge's layer is at least as fast as what torch.compile makes of torch's, the times as text).

    torch.compile runs the conv without its bias and fuses bias and activation
    into one pointwise pass, so torch's side is timed as the conv alone plus,
    where there is an activation, one in-place pass; on CUDA both sides are
    timed on the GPU's clock (a replayed CUDA graph), on the CPU on the
    host's. Inference only."""
    key = ("compiled",) + _key(candidate, act, x)
    if key in _cache:
        return _cache[key]
    ours = candidate.module()
    c = candidate.conv
    post = _INPLACE_ACTIVATIONS.get(candidate.activation) if candidate.activation else act

    def theirs():
        y = F.conv2d(x, c.weight, None, c.stride, c.padding, c.dilation, c.groups)
        return post(y) if post is not None else y

    def mine():
        y = ours(x)
        return act(y) if act is not None and candidate.activation is None else y

    with torch.no_grad():
        theirs_us, ours_us, clock = _compiled_times_us(theirs, mine, x.device)
    result = (
        ours_us * _MARGIN <= theirs_us,
        f"{clock} {ours_us:.1f} us vs {theirs_us:.1f} us for the conv and the one pass torch.compile runs",
    )
    _cache[key] = result
    return result


def folding_pays(conv: torch.nn.Conv2d, bn: torch.nn.BatchNorm2d, folded: torch.nn.Conv2d, x: torch.Tensor):
    """(the folded conv is not slower than conv then BatchNorm, the measured times as text), cached.

    Folding removes the BatchNorm's pass but gives the conv a bias, which some
    engines add as a pass of its own: it is kept unless it measures more than
    the margin slower."""
    key = ("fold", str(x.device), x.dtype, _layout(x), tuple(x.shape), tuple(conv.weight.shape), conv.bias is not None)
    key += (tuple(conv.stride), str(conv.padding), tuple(conv.dilation), conv.groups, conv.padding_mode)
    if key in _cache:
        return _cache[key]
    with torch.no_grad():
        before_us = _median_us(lambda: bn(conv(x)), x.device)
        after_us = _median_us(lambda: folded(x), x.device)
    result = (after_us <= before_us * _MARGIN, f"folded {after_us:.1f} us vs {before_us:.1f} us with the BatchNorm")
    _cache[key] = result
    return result


def _run(modules, post, x: torch.Tensor, training: bool):
    """The modules then ``post`` on x: a forward without a graph in eval mode, forward and backward in training.

    The backward returns its gradients instead of accumulating them: the
    parameters are the model's own, whose ``.grad`` the timing must not touch."""

    def call(t):
        for m in modules:
            t = m(t)
        return post(t) if post is not None else t

    if not training:
        with torch.no_grad():
            return call(x)
    inputs = [x.detach().requires_grad_()]
    inputs += [p for m in modules for p in m.parameters() if p.requires_grad]
    out = call(inputs[0])
    torch.autograd.grad(out.sum(), inputs, allow_unused=True)
    return out


def faster_with_opforge(
    candidate: ConvCandidate | PrepackedCandidate, act: torch.nn.Module | None, x: torch.Tensor, before: tuple = ()
) -> tuple[bool, str, float]:
    """(opforge is at least as fast, the measured times as text, opforge's time), cached per process.

    opforge's layer (with ``candidate.activation`` fused, else followed by
    ``act``) against ``before`` (the modules the layer runs as otherwise,
    default the candidate's conv), followed by ``act``."""
    layers = tuple(before) or (candidate.conv,)
    key = _key(candidate, act, x) + (tuple(type(m).__name__ for m in layers),)
    if key in _cache:
        return _cache[key]
    training = candidate.conv.training
    # torch's layers are timed once per layer, however many candidates are timed against them.
    theirs_key = ("torch",) + key[1:]
    if theirs_key not in _cache:
        _cache[theirs_key] = _median_us(lambda: _run(layers, act, x, training), x.device)
    theirs_us = _cache[theirs_key]
    ours = candidate.module()
    ours_us = _median_us(lambda: _run((ours,), None if candidate.activation else act, x, training), x.device)
    # A tie within the timing's noise keeps torch's layers: replacing must pay.
    win = ours_us * _MARGIN <= theirs_us
    result = (win, f"measured {ours_us:.1f} us vs {theirs_us:.1f} us for torch's layers", ours_us)
    _cache[key] = result
    return result


def training_times_us(candidate, act: torch.nn.Module | None, x: torch.Tensor, options: dict, extra: tuple = ()):
    """Forward + backward time (us) of each option (name: modules run in turn on ``x``), cached per
    process by the layer's key (``candidate``: its ``op`` and ``conv``; ``act``; ``extra``) and the name."""
    key = _key(candidate, act, x) + tuple(extra)
    times = {}
    for name, modules in options.items():
        if key + (name,) not in _cache:
            _cache[key + (name,)] = _median_us(functools.partial(_run, modules, None, x, True), x.device)
        times[name] = _cache[key + (name,)]
    return times


def winner(times: dict[str, float], incumbent: str) -> str:
    """The fastest option, unless it is not ``_MARGIN`` faster than ``incumbent``: a tie keeps what is there."""
    best = min(times, key=times.get)
    return best if times[best] * _MARGIN <= times[incumbent] else incumbent
