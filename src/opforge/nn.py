"""nn.Module wrappers of opforge ops, for use inside models."""

from __future__ import annotations

import torch

from .ops.add import add, add_relu


class Add(torch.nn.Module):
    """``forward(a, b) = a + b`` (opforge.add)."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return add(a, b)


class AddReLU(torch.nn.Module):
    """``forward(a, b) = relu(a + b)`` in one kernel (opforge.add_relu).

    A residual block's ``relu(x + shortcut)`` or a bias-then-ReLU is a
    drop-in use::

        class Block(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = torch.nn.Linear(64, 64)
                self.act = opforge.nn.AddReLU()
            def forward(self, x):
                return self.act(self.fc(x), x)
    """

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return add_relu(a, b)
