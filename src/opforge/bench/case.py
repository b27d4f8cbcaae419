"""What a bench case is (:class:`BenchCase`) and how a family declares its cases.

A module of ``opforge.bench.cases`` decorates one function with
``@register("<family>")``; the function takes the device ("cpu" or "cuda")
and returns a list of :class:`BenchCase`. This module imports nothing of
opforge, so case modules can import it without importing what loads them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch


@dataclasses.dataclass
class BenchCase:
    op: str  # the op as users know it, e.g. "add_relu"
    label: str  # the shape, e.g. "N=2^24" or "8192x8192"
    dtype: torch.dtype
    make_inputs: Callable[[], Sequence]  # fresh random inputs on the device (a list of args)
    ours: Callable  # opforge's op, called with the inputs
    eager: Callable  # the eager PyTorch composition users would otherwise write
    eager_name: str = "eager"
    peer: Callable | None = None  # another library's op (torchvision's nms, cuDNN conv), if any
    peer_name: str | None = None
    compile: bool = True  # also time torch.compile(eager)
    bytes_fwd: int = 0  # fewest bytes forward must move (0: not memory-bound)
    bytes_bwd: int = 0  # fewest bytes backward must move
    flops_fwd: float = 0.0  # for compute-bound cases (TFLOP/s is reported)
    grad_inputs: tuple[int, ...] = ()  # inputs that need grads for bwd/full modes; () = forward only
    atol: float | None = None  # correctness tolerance vs eager (None: per-dtype default)
    rtol: float | None = None
    compare: Callable | None = None  # custom check(ours_out, eager_out) -> None, raises on mismatch
    # Forward outputs are checked against it instead of eager when given: the
    # same computation in float64 (every provider, eager included, must then be
    # within tolerance of it). Gradients are still compared with eager's.
    reference: Callable | None = None
    quick: bool = False  # part of `opforge bench --quick`
    flops_bwd: float = 0.0  # FLOPs of the backward pass (compute-bound cases)
    # The op ends in a ReLU: two correct implementations can round an output
    # within an ulp or so of zero to opposite sides, and ReLU's gradient then
    # passes at one and not the other. Gradients are compared with the
    # incoming gradient zeroed where the two outputs' signs disagree.
    relu_output: bool = False
    # Absolute tolerance for the gradients of some inputs (input index ->
    # atol), where the gradient is a long reduction (a conv's weight and bias
    # gradients sum N x H x W terms, whose rounding grows with the count).
    grad_atol: dict[int, float] = dataclasses.field(default_factory=dict)


_REGISTRY: dict[str, Callable[[str], list[BenchCase]]] = {}


def register(family: str):
    """Decorator: ``@register("softmax") def cases(device): return [...]``."""

    def wrap(fn):
        _REGISTRY[family] = fn
        return fn

    return wrap
