"""``add`` and ``add_relu``: wrappers, fake kernels and autograd.

Semantics are torch's: ``add(a, b) == torch.add(a, b)`` and
``add_relu(a, b) == torch.relu(a + b)``, with broadcasting, any strides, 0-dim
and empty tensors, NaN/inf as in torch, and the result's dtype and memory
format as torch would give. Inputs of different float dtypes are promoted by
torch's rules (one conversion pass for the narrower input). Inputs on
different devices are an error: nothing is copied implicitly.

Note on the seeds' ``slow_add`` (``z * (z > 0)``): it differs from
``relu(a + b)`` only at ``-inf`` (``-inf * 0`` is NaN, relu gives 0);
``add_relu`` follows relu.
"""

from __future__ import annotations

import torch

from . import _checks
from ._dispatch import call

_ns = torch.ops.opforge


def _check_binary(op: str, a, a_name: str, b, b_name: str) -> None:
    _checks.float_tensor(op, a_name, a)
    _checks.float_tensor(op, b_name, b)
    _checks.same_device(op, a_name, a, b_name, b)
    _checks.broadcast_shape(op, a_name, a, b_name, b)


def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a + b`` with broadcasting, in one kernel.

    >>> import torch, opforge
    >>> opforge.add(torch.ones(2, 3), torch.arange(3.0))
    tensor([[1., 2., 3.],
            [1., 2., 3.]])
    """
    # The kernel checks dtypes, devices and shapes with the same messages;
    # argument types (and shapes, only when they differ) are checked here
    # first, at the cost of a few microseconds at most.
    _checks.tensor_arg("opforge.add", "a", a)
    _checks.tensor_arg("opforge.add", "b", b)
    if a.shape != b.shape:
        _checks.broadcast_shape("opforge.add", "a", a, "b", b)
    return call(_ns.add.default, a, b)


def add_relu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.relu(a + b)`` fused into one kernel (one read of each input, one write).

    >>> import torch, opforge
    >>> opforge.add_relu(torch.tensor([1.0, -2.0]), torch.tensor([0.5, 1.0]))
    tensor([1.5000, 0.0000])
    """
    _checks.tensor_arg("opforge.add_relu", "a", a)
    _checks.tensor_arg("opforge.add_relu", "b", b)
    if a.shape != b.shape:
        _checks.broadcast_shape("opforge.add_relu", "a", a, "b", b)
    return call(_ns.add_relu.default, a, b)


# --------------------------------------------------------------------------- fake kernels


def _fake_binary(op: str, a, a_name: str, b, b_name: str) -> torch.Tensor:
    _check_binary(op, a, a_name, b, b_name)
    # aten's add allocates through the same TensorIterator rules as our
    # kernels, so shape, dtype and strides (memory format) agree.
    return torch.add(a, b)


@torch.library.register_fake("opforge::add")
def _add_fake(a, b):
    return _fake_binary("opforge.add", a, "a", b, "b")


@torch.library.register_fake("opforge::add_relu")
def _add_relu_fake(a, b):
    return _fake_binary("opforge.add_relu", a, "a", b, "b")


@torch.library.register_fake("opforge::_add_relu_backward")
def _add_relu_backward_fake(grad, result):
    return _fake_binary("opforge._add_relu_backward", grad, "grad", result, "result")


# --------------------------------------------------------------------------- autograd


def _to_input(grad: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """Reduce a broadcast gradient back to the input's shape and dtype."""
    if grad.shape != shape:
        grad = grad.sum_to_size(shape)
    return grad.to(dtype)


def _save_input_meta(ctx, inputs) -> None:
    a, b = inputs
    ctx.a_meta = (a.shape, a.dtype)
    ctx.b_meta = (b.shape, b.dtype)


def _add_setup(ctx, inputs, output):
    _save_input_meta(ctx, inputs)


def _add_backward(ctx, grad):
    ga = _to_input(grad, *ctx.a_meta) if ctx.needs_input_grad[0] else None
    gb = _to_input(grad, *ctx.b_meta) if ctx.needs_input_grad[1] else None
    return ga, gb


def _add_relu_setup(ctx, inputs, output):
    _save_input_meta(ctx, inputs)
    ctx.save_for_backward(output)


def _add_relu_backward(ctx, grad):
    (result,) = ctx.saved_tensors
    g = _ns._add_relu_backward.default(grad, result)
    ga = _to_input(g, *ctx.a_meta) if ctx.needs_input_grad[0] else None
    gb = _to_input(g, *ctx.b_meta) if ctx.needs_input_grad[1] else None
    return ga, gb


def _relu_backward_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])


def _relu_backward_backward(ctx, grad_grad):
    # d/d(grad) of grad * (result > 0) is the same mask; d/d(result) is zero
    # almost everywhere, so second derivatives of add_relu are exact.
    (result,) = ctx.saved_tensors
    return _ns._add_relu_backward.default(grad_grad, result), None


torch.library.register_autograd("opforge::add", _add_backward, setup_context=_add_setup)
torch.library.register_autograd("opforge::add_relu", _add_relu_backward, setup_context=_add_relu_setup)
torch.library.register_autograd(
    "opforge::_add_relu_backward", _relu_backward_backward, setup_context=_relu_backward_setup
)
