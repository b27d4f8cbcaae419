"""Calling registered ops from the Python wrappers with the least overhead.

Autograd registered from Python (``torch.library.register_autograd``) runs a
Python function on every call, gradients or not: several microseconds that
dominate small tensors. When no input needs a gradient, ``call`` dispatches
straight past the autograd layer to the kernel, which gives the same result
(a tensor that does not require grad). Under torch.compile the op is traced
normally.
"""

from __future__ import annotations

import torch

_below_autograd = torch._C._AutoDispatchBelowAutograd


def call(op, *args):
    if torch.compiler.is_compiling():
        return op(*args)
    if torch.is_grad_enabled():
        for a in args:
            if isinstance(a, torch.Tensor) and a.requires_grad:
                return op(*args)
    with _below_autograd():
        return op(*args)
