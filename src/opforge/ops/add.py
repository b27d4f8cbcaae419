"""``add`` and ``add_relu``: the public wrappers.

Semantics are torch's: ``add(a, b) == torch.add(a, b)`` and
``add_relu(a, b) == torch.relu(a + b)``, with broadcasting, any strides, 0-dim
and empty tensors, NaN/inf as in torch, and the result's dtype and memory
format as torch would give. Inputs of different float dtypes are promoted by
torch's rules (one conversion pass for the narrower input). Inputs on
different devices are an error: nothing is copied implicitly. Either input
may be a Python number, as in ``torch.add``.

Checks, shape functions and autograd are C++ (csrc/add.cpp); the wrappers
only name the arguments, so a call costs what ``torch.ops.opforge.add`` costs.

Note on the seeds' ``slow_add`` (``z * (z > 0)``): it differs from
``relu(a + b)`` only at ``-inf`` (``-inf * 0`` is NaN, relu gives 0);
``add_relu`` follows relu.
"""

from __future__ import annotations

import torch

# The overload packets: a Python number for a or b picks its overload.
_add = torch.ops.opforge.add
_add_relu = torch.ops.opforge.add_relu


def add(a: torch.Tensor | float, b: torch.Tensor | float) -> torch.Tensor:
    """``a + b`` with broadcasting, in one kernel.

    >>> import torch, opforge
    >>> opforge.add(torch.ones(2, 3), torch.arange(3.0))
    tensor([[1., 2., 3.],
            [1., 2., 3.]])
    """
    return _add(a, b)


def add_relu(a: torch.Tensor | float, b: torch.Tensor | float) -> torch.Tensor:
    """``torch.relu(a + b)`` fused into one kernel (one read of each input, one write).

    >>> import torch, opforge
    >>> opforge.add_relu(torch.tensor([1.0, -2.0]), torch.tensor([0.5, 1.0]))
    tensor([1.5000, 0.0000])
    """
    return _add_relu(a, b)
