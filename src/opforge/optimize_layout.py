"""Channels-last inside an NCHW model: ``opforge.optimize``'s one model-level choice.

oneDNN, which runs CPU convolutions, works in channels_last; fed an NCHW
tensor, each conv reorders its input and output. On CUDA, cuDNN's
tensor-core convolutions and opforge's fused kernels are fastest in
channels_last (torch.compile's layout optimization picks it for
convolutions too). A model whose user passes NCHW batches can instead run
channels_last inside: a forward pre-hook on the model converts its 4-d
inputs once, every layer then keeps channels_last (as torch's ops do), and a
forward hook converts 4-d outputs back, so the caller sees NCHW in and NCHW
out, the parameters keep their memory format, and the values are the same
(within the rounding of another convolution algorithm).

It is taken only where it is measured: CPU or CUDA, 4-d NCHW example
inputs on one device, the hooked model gives the original's outputs (a
``.view()`` that needs NCHW strides raises, and the choice is dropped), and
it times at least 3% faster than the original on the example inputs, with
torch's own layers, before any layer is replaced (the two timed in
alternating rounds, so that a host whose speed drifts meanwhile shifts
both alike). In eval mode the timing is
of a forward (on CUDA with the weights of the convs a BatchNorm follows in
channels_last, as opforge's folded layers hand them to cuDNN); in training
mode of a forward and a backward, on a copy of the model, so that the
model's BatchNorm statistics and gradients stay as they were (and the
caller's random stream too). The timing is cached per process, by the
model's architecture and mode and the inputs' shapes and device. An
eval-mode model that keeps NCHW there gets a second look (``faster_layout``):
it is optimized both ways, its layers timed and chosen on each layout
(opforge's layers take channels_last inputs without the per-call weight
copy that torch's convs make), and the channels_last one is kept where it
times 3% faster with the same outputs.
Under torch.compile on CUDA the hooks do nothing: inductor chooses the
layout of a traced graph. On the CPU they stay traced (compiled NCHW
models of the CPU table, hooks traced, measured 1.22-1.46x plain compile).
"""

from __future__ import annotations

import copy
import statistics

import torch
from torch.utils._pytree import tree_map

from .optimize_choice import _MARGIN, _median_us
from .optimize_fold import copies_weight_once
from .optimize_patterns import find_chains, is_opforge_layer


def _is_nchw_batch(t) -> bool:
    """A 4-d floating tensor in NCHW order that channels_last would reorder."""
    if not isinstance(t, torch.Tensor) or t.dim() != 4 or not t.is_floating_point():
        return False
    return t.is_contiguous() and not t.is_contiguous(memory_format=torch.channels_last)


def _to_channels_last(t):
    return t.contiguous(memory_format=torch.channels_last) if _is_nchw_batch(t) else t


def _to_nchw(t):
    return t.contiguous() if isinstance(t, torch.Tensor) and t.dim() == 4 else t


def _inductor_chooses(tensors) -> bool:
    """Traced on CUDA, the hooks step aside: inductor's layout optimization picks the graph's
    layout itself, and a forced channels_last there measured slower (resnet18, batch 64)."""
    if not torch.compiler.is_compiling():
        return False
    return any(isinstance(t, torch.Tensor) and t.is_cuda for t in torch.utils._pytree.tree_leaves(tensors))


def channels_last_inputs(module: torch.nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook: the call's 4-d NCHW tensors as channels_last."""
    if _inductor_chooses((args, kwargs)):
        return None
    return tree_map(_to_channels_last, args), tree_map(_to_channels_last, kwargs)


def nchw_outputs(module: torch.nn.Module, args: tuple, kwargs: dict, output):
    """Forward hook: the call's 4-d outputs back in NCHW order."""
    if _inductor_chooses(output):
        return None
    return tree_map(_to_nchw, output)


def has_channels_last_hooks(model: torch.nn.Module) -> bool:
    return any(h is channels_last_inputs for h in model._forward_pre_hooks.values())


def install_channels_last(model: torch.nn.Module) -> None:
    """The two hooks on ``model`` (once): NCHW inputs run channels_last inside, 4-d outputs come back NCHW."""
    if not has_channels_last_hooks(model):
        model.register_forward_pre_hook(channels_last_inputs, with_kwargs=True)
        model.register_forward_hook(nchw_outputs, with_kwargs=True)


def _drift(t: torch.Tensor, training: bool = False) -> float:
    """How far one model's outputs may move between the two layouts: their convolutions run other
    algorithms (other summation orders), and on CUDA a float32 conv may multiply in TF32 (10-bit
    operands). In training, BatchNorm divides by the batch's own variances, which over a small
    batch and plane magnify those roundings (5e-4 of the scale: mobilenet_v2, batch 4, 32x32).
    A forward that depends on NCHW strides gives other values, far outside this."""
    if training:
        return max(_drift(t), 1e-2)
    if t.dtype in (torch.float16, torch.bfloat16):
        return 5e-2 if t.is_cuda else 1e-3
    if t.dtype == torch.float32 and t.is_cuda:
        return 1e-2
    return 1e-5


def _same(a, b, training: bool = False, floor: float = 0.0) -> bool:
    flat_a, flat_b = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    if len(flat_a) != len(flat_b):
        return False
    for x, y in zip(flat_a, flat_b, strict=True):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor):
            if x.shape != y.shape or x.dtype != y.dtype or not _strides_agree(x, y):
                return False
            tol = max(_drift(x, training), floor)
            scale = y.abs().max().item() if y.numel() and y.is_floating_point() else 1.0
            if not torch.allclose(x, y, atol=tol * (scale + 1), rtol=tol):
                return False
    return True


def _strides_agree(x: torch.Tensor, y: torch.Tensor) -> bool:
    """The same memory order: strides of size-1 dimensions say nothing (a 1x1 plane is both NCHW and
    channels_last contiguous, with either stride)."""
    return all(a == b for a, b, n in zip(x.stride(), y.stride(), x.shape, strict=True) if n > 1)


def _same_in_float32(model: torch.nn.Module, example_inputs: tuple, device: torch.device) -> bool:
    """For a half-type training model: its two layouts' outputs compared on a float32 copy. A
    half-type step moves its outputs by up to 8e-2 of their scale between the layouts (resnet50,
    bfloat16, batch 64: BatchNorm over batch statistics, 53 times), more than the check can allow;
    in float32 rounding is far below it, and a forward that reads NCHW strides stands out as in
    any dtype."""
    if not model.training or not any(p.dtype in (torch.float16, torch.bfloat16) for p in model.parameters()):
        return False
    wide = copy.deepcopy(model).float()
    inputs = tree_map(
        lambda t: t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t, example_inputs
    )
    call = _one_call(wide, inputs)
    plain = _seeded(call, device)
    install_channels_last(wide)
    return _same(_seeded(call, device), plain, training=True)


_NOT_FASTER = "NCHW kept: channels_last inside is not faster"

# The two timings per model architecture and input, for the process: optimizing one model twice
# makes one choice, so that two optimized copies share a state_dict layout (as the layers' cache does).
_timings: dict[tuple, tuple[float, float]] = {}


def _architecture(model: torch.nn.Module, batches: list[torch.Tensor]) -> tuple:
    """What the timing depends on: the modules and their settings (a conv's stride, a pool's
    kernel: ``extra_repr``), the parameters' shapes and dtypes, the inputs' and their device."""
    named = model.named_modules()
    modules = tuple((name, type(m).__module__, type(m).__qualname__, m.extra_repr()) for name, m in named)
    params = tuple((name, tuple(p.shape), p.dtype) for name, p in model.named_parameters())
    inputs = tuple((tuple(t.shape), t.dtype, t.stride(), str(t.device)) for t in batches)
    return (type(model).__module__, type(model).__qualname__, modules, params, inputs)


def _one_call(model: torch.nn.Module, example_inputs: tuple):
    """What a model-level choice times, in the model's mode: eval, a forward under no_grad;
    training, a forward and the backward of its outputs' sum (a training step less the optimizer),
    the parameters' gradients returned, not accumulated: no ``.grad`` is touched."""
    if not model.training:

        def forward():
            with torch.no_grad():
                return model(*example_inputs)

        return forward
    params = [p for p in model.parameters() if p.requires_grad]

    def forward_backward():
        out = model(*example_inputs)
        leaves = torch.utils._pytree.tree_leaves(out)
        losses = [t.float().sum() for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
        if losses and params:
            torch.autograd.grad(sum(losses), params, allow_unused=True)
        return tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out)

    return forward_backward


def _seeded(fn, device: torch.device):
    """fn's result with the random stream seeded alike for every call (dropout draws the same masks
    in both layouts), the caller's stream left as it was."""
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(0)
        return fn()


class _Inside(torch.nn.Module):
    """``model`` called through the hooks, beside the model itself, so that the two layouts can be
    timed in turns (no hook is put on or taken off between the rounds)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model
        self.training = model.training  # the attribute only: .train() would set the model's modules

    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs)


def _hooked_call(model: torch.nn.Module, example_inputs: tuple, device: torch.device, plain, same):
    """``_one_call`` of ``model`` with the hooks on, where its outputs pass ``same(hooked, plain)``;
    elsewhere the error (or "outputs differ") is raised. The model itself gets no hook."""
    inside = _Inside(model)
    install_channels_last(inside)
    call = _one_call(inside, example_inputs)
    if not same(_seeded(call, device), plain):
        raise RuntimeError("outputs differ")
    return call


def _interleaved_us(
    first, second, device: torch.device, rounds: int = 5, calls: int = 3, before_each=(None, None)
) -> tuple[float, float]:
    """Median us per call of ``first`` and of ``second``, timed in alternating rounds: a host whose
    speed drifts while they are timed shifts both alike. ``before_each``: what runs, untimed, before
    each round of ``first`` and of ``second`` (one model put into either of two states)."""
    a, b = [], []
    for _ in range(rounds):
        for fn, prepare, samples in ((first, before_each[0], a), (second, before_each[1], b)):
            if prepare is not None:
                prepare()
            samples.append(_median_us(fn, device, calls=calls, repeats=1, sample_s=None))
    return statistics.median(a), statistics.median(b)


def _timed(inside_call, nchw_call, device: torch.device, key: tuple) -> tuple[float, float]:
    """(inside_us, nchw_us), timed in turns once per ``key`` in the process."""
    if key not in _timings:
        _timings[key] = _seeded(lambda: _interleaved_us(inside_call, nchw_call, device), device)
    return _timings[key]


def _nchw_batches(example_inputs: tuple) -> list[torch.Tensor]:
    """The example inputs' tensors where both looks apply (all on one CPU or CUDA device, one of them
    an NCHW batch), else []."""
    batches = [t for t in torch.utils._pytree.tree_leaves(example_inputs) if isinstance(t, torch.Tensor)]
    if not batches or any(t.device != batches[0].device for t in batches):
        return []
    if batches[0].device.type not in ("cpu", "cuda") or not any(_is_nchw_batch(t) for t in batches):
        return []
    return batches


def _with_folded_weights_copied(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of an eval-mode CUDA ``model`` as it will run channels_last inside once optimized: each
    conv a BatchNorm follows will be folded into a layer that hands cuDNN a channels_last copy of its
    weight, made once (``optimize_fold.as_installed``), where torch's conv copies an NCHW weight on
    every call. Timed with torch's layers, the copy's conv weights are channels_last already."""
    inside = copy.deepcopy(model)
    for chain in find_chains(inside):
        conv = inside.get_submodule(chain.conv)
        if chain.bn is not None and copies_weight_once(conv):
            conv.weight.data = conv.weight.data.contiguous(memory_format=torch.channels_last)
    return inside


def _conv_whose_cpu_backward_crashes(model: torch.nn.Module) -> str | None:
    """The name of a conv whose weight gradient torch 2.14's CPU kernels compute out of bounds in
    channels_last (a segfault with 3-15 input channels, 1x1, stride 2, 96x96 or 224x224 inputs; 16
    channels ran): timm's repvgg stem. Not run at all rather than taken down with the process."""
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Conv2d) and m.kernel_size == (1, 1) and m.stride != (1, 1):
            if m.in_channels // m.groups < 16 and m.weight.requires_grad:
                return name
    return None


def choose_channels_last(model: torch.nn.Module, example_inputs: tuple) -> tuple[bool, str]:
    """Install the hooks on ``model`` where they pay (see the module's docs); (installed, why)."""
    if has_channels_last_hooks(model):
        return True, "already runs channels_last inside"
    batches = _nchw_batches(example_inputs)
    if not batches:
        return False, ""
    device = batches[0].device
    if model.training and device.type == "cpu":
        crashing = _conv_whose_cpu_backward_crashes(model)
        if crashing:
            return False, (
                f"NCHW kept: torch's CPU backward of a strided 1x1 conv on fewer than 16 input channels "
                f"({crashing}) can crash in channels_last"
            )
    # A training model is timed as a copy: its steps change BatchNorm statistics and gradients.
    try:
        probe = copy.deepcopy(model) if model.training else model
    except Exception as e:  # noqa: BLE001 - e.g. a lock or a handle among the model's attributes
        return False, f"NCHW kept: a training model is timed on a copy, and this one does not copy ({str(e)[:80]})"
    call = _one_call(probe, example_inputs)
    try:
        plain = _seeded(call, device)
    except Exception:  # noqa: BLE001 - the model's own error surfaces where the caller runs it
        return False, ""

    def same(hooked, plain) -> bool:
        return _same(hooked, plain, model.training) or _same_in_float32(model, example_inputs, device)

    inside, layers = probe, "torch's layers"
    if device.type == "cuda" and not model.training:
        inside, layers = _with_folded_weights_copied(model), "torch's layers, weights as opforge's hand them to cuDNN"
    try:
        inside_call = _hooked_call(inside, example_inputs, device, plain, same)
    except Exception as e:  # noqa: BLE001 - e.g. a .view() that needs NCHW strides
        return False, f"NCHW kept: the model does not run channels_last inside ({str(e)[:80]})"
    key = (_architecture(model, batches), model.training)
    inside_us, nchw_us = _timed(inside_call, call, device, key)
    what = "forward + backward" if model.training else "forward"
    times = f"measured {inside_us / 1e3:.2f} ms vs {nchw_us / 1e3:.2f} ms in NCHW, {what}, {layers}"
    if inside_us * _MARGIN > nchw_us:
        return False, f"{_NOT_FASTER} ({times})"
    install_channels_last(model)
    return True, f"NCHW inputs run as channels_last inside, outputs converted back ({times})"


def second_look_applies(model: torch.nn.Module, why: str) -> bool:
    """The first choice kept NCHW for an eval-mode model that runs channels_last inside, only because
    that was not faster with torch's layers: ``optimize`` then optimizes it both ways (``faster_layout``)."""
    return not model.training and why.startswith(_NOT_FASTER)


def faster_layout(nchw: torch.nn.Module, inside: torch.nn.Module, example_inputs: tuple) -> tuple[bool, str]:
    """(take ``inside``, what was found): the second look, for an eval-mode model that kept NCHW.

    ``nchw`` and ``inside`` are the model optimized twice, its layers timed and
    replaced on NCHW inputs, and with the hooks on, on channels_last ones. The
    first choice times torch's convs, which copy an NCHW weight to channels_last
    on every call that gets a channels_last input, while opforge's layers reorder
    (CPU) or copy (CUDA) theirs once, and each layout's layers are chosen for it:
    so the optimized model can gain from channels_last where the original lost
    (host-bound CUDA batches of 1: fused engines that take channels_last alone).
    ``inside`` is taken where it times 3% faster and gives the same outputs;
    cached per process like the first choice. Where ``inside`` holds none of
    opforge's layers it is the model the first choice timed: NCHW stays (a
    second timing of the same two models would only measure noise)."""
    if not any(is_opforge_layer(m) for m in inside.modules()):
        return False, "NCHW kept: no layer of the model is opforge's in channels_last either"
    batches = _nchw_batches(example_inputs)
    device = batches[0].device
    nchw_call, inside_call = _one_call(nchw, example_inputs), _one_call(inside, example_inputs)
    try:
        plain = _seeded(nchw_call, device)
    except Exception:  # noqa: BLE001 - the model's own error surfaces where the caller runs it
        return False, ""
    try:
        # Each layout's layers may be other engines: rounding differs by more than one conv's.
        if not _same(_seeded(inside_call, device), plain, floor=1e-3):
            return False, "NCHW kept: the model optimized channels_last inside gives other outputs"
    except Exception as e:  # noqa: BLE001 - as in the first choice, which found the model runs inside
        return False, f"NCHW kept: the model optimized channels_last inside fails ({str(e)[:80]})"
    inside_us, nchw_us = _timed(inside_call, nchw_call, device, ("optimized", _architecture(nchw, batches)))
    times = (
        f"measured {inside_us / 1e3:.2f} ms vs {nchw_us / 1e3:.2f} ms in NCHW, forward, "
        "opforge's layers chosen for each layout"
    )
    if inside_us * _MARGIN > nchw_us:
        return False, f"NCHW kept with opforge's layers too ({times})"
    return True, f"NCHW inputs run as channels_last inside with opforge's layers, outputs converted back ({times})"
