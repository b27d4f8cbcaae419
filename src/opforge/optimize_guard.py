"""``opforge.optimize``'s last check: the whole model, optimized, against the model as it was.

Each layer is replaced only where it times faster on its own input, but a
model is more than its layers timed alone: on a host-bound step (a CUDA
batch of 1, forward and backward) several replacements that each won by a
few percent, within the timing's noise, can add up to a slower model. So
where example inputs are given and anything changed, the model is timed
both ways, in its own mode (eval: a forward; training: a forward and a
backward), in alternating rounds, and where the optimized model is not at
least 3% faster (the margin each layer must win by) the model is put back
as it was.

Both versions are one model object: ``ModelState`` records what ``optimize``
changes (each module's children, parameters, buffers, hooks and mode) and
puts it back in place, so an optimizer or hook handle the caller holds keeps
working whichever version stays, and no copy of the model is made. The
timing changes nothing the caller sees: BatchNorm statistics are restored,
gradients are computed without touching ``.grad`` (``optimize_layout._one_call``,
the call the layout choice times), and the random stream is forked. The
verdict is cached per process like the layers' own timings.
"""

from __future__ import annotations

import time

import torch

from .optimize_choice import _MARGIN
from .optimize_layout import _architecture, _interleaved_us, _one_call, _seeded
from .optimize_patterns import is_scripted

# Per module, the dicts optimize may change. Restored in place (clear, update): a hook handle
# holds a reference to its dict, and must still remove the hook afterwards.
_STATE_DICTS = (
    "_modules",
    "_parameters",
    "_buffers",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)

_verdicts: dict[tuple, tuple[float, float]] = {}

# Rounds of the two versions in turn, and calls per round (one where a call is slow).
_ROUNDS, _CALLS, _SLOW_S = 5, 3, 0.25


class ModelState:
    """What ``optimize`` may change in ``model``, recorded, to be put back by ``apply``."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.saved = [
            (m, m.training, [(name, dict(getattr(m, name))) for name in _STATE_DICTS if hasattr(m, name)])
            for m in _changeable(model)
        ]

    def apply(self) -> None:
        for module, training, dicts in self.saved:
            module.training = training
            for name, content in dicts:
                current = getattr(module, name)
                current.clear()
                current.update(content)

    def changed(self) -> bool:
        """Whether the model differs from this record now."""
        if [m for m, _, _ in self.saved] != _changeable(self.model):
            return True
        for module, training, dicts in self.saved:
            if module.training != training:
                return True
            for name, content in dicts:
                current = getattr(module, name)
                if current.keys() != content.keys() or any(current[k] is not v for k, v in content.items()):
                    return True
        return False


def _changeable(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules optimize may change: not those of TorchScript, whose compiled code it leaves."""
    return [m for m in model.modules() if not is_scripted(m)]


def _timed(before: ModelState, after: ModelState, example_inputs: tuple, device: torch.device):
    """(before_us, after_us): the model's two versions, warmed up, then timed in alternating rounds."""
    before.apply()
    call_before = _one_call(before.model, example_inputs)  # the parameters of each version
    call_before()
    after.apply()
    call_after = _one_call(after.model, example_inputs)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    call_after()
    sync()
    calls = 1 if time.perf_counter() - start > _SLOW_S else _CALLS
    states = (before.apply, after.apply)
    return _interleaved_us(call_before, call_after, device, _ROUNDS, calls, before_each=states)


def keep_optimized(before: ModelState, example_inputs: tuple) -> tuple[bool, str]:
    """(the optimized model, as it is now, stays; what was measured). Where it is not 3% faster than
    ``before`` (the model as it was), ``before`` is applied: the model is back as it was."""
    model = before.model
    after = ModelState(model)
    tensors = [t for t in torch.utils._pytree.tree_leaves(example_inputs) if isinstance(t, torch.Tensor)]
    if not tensors or tensors[0].device.type not in ("cpu", "cuda"):
        return True, ""
    device = tensors[0].device
    # The optimized version as it runs: its modules, and which of them have hooks (channels_last inside).
    structure = tuple(
        (name, type(m).__qualname__, len(m._forward_pre_hooks), len(m._forward_hooks))
        for name, m in model.named_modules()
    )
    before.apply()
    key = (_architecture(model, tensors), model.training, structure)
    after.apply()
    if key not in _verdicts:
        buffers = {id(b): (b, b.detach().clone()) for s in (before, after) for b in _buffers_of(s)}
        try:
            _verdicts[key] = _seeded(lambda: _timed(before, after, example_inputs, device), device)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory: the layers' own timings stand
            after.apply()
            return True, f"the whole model not timed ({type(e).__name__}: {str(e)[:80]})"
        finally:
            with torch.no_grad():
                for b, saved in buffers.values():
                    b.copy_(saved)
        after.apply()
    before_us, after_us = _verdicts[key]
    what = "forward + backward" if model.training else "forward"
    times = f"{after_us / 1e3:.2f} ms vs {before_us / 1e3:.2f} ms as it was, {what}"
    # The layers' margin: a whole model that times within the noise of its original gains nothing.
    if after_us * _MARGIN <= before_us:
        return True, f"the whole model optimized: {times}"
    before.apply()
    return False, f"the whole model optimized is not 3% faster ({times}): put back as it was"


def _buffers_of(state: ModelState) -> list[torch.Tensor]:
    return [b for _, _, dicts in state.saved for name, content in dicts if name == "_buffers" for b in content.values()]
