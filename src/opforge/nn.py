"""nn.Module wrappers of opforge ops, for use inside models."""

from __future__ import annotations

import torch

from .ops.add import add, add_relu
from .ops.softmax import log_softmax, scaled_masked_softmax, softmax


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


class Softmax(torch.nn.Module):
    """``forward(x) = softmax(x, dim)`` (opforge.softmax); a drop-in for ``torch.nn.Softmax``."""

    def __init__(self, dim: int = -1):
        super().__init__()
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return softmax(x, self.dim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


class LogSoftmax(torch.nn.Module):
    """``forward(x) = log_softmax(x, dim)`` (opforge.log_softmax); a drop-in for ``torch.nn.LogSoftmax``."""

    def __init__(self, dim: int = -1):
        super().__init__()
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return log_softmax(x, self.dim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


class ScaledMaskedSoftmax(torch.nn.Module):
    """``forward(scores, mask=None) = softmax(scores * scale + mask, -1)`` in one pass
    (opforge.scaled_masked_softmax), with an optional causal mask.

    In an attention block::

        attn = opforge.nn.ScaledMaskedSoftmax(scale=head_dim ** -0.5, causal=True)
        p = attn(q @ k.transpose(-2, -1))          # (..., Lq, Lk)
        out = p @ v
    """

    def __init__(self, scale: float = 1.0, causal: bool = False):
        super().__init__()
        self.scale = float(scale)
        self.causal = bool(causal)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return scaled_masked_softmax(x, mask, self.scale, self.causal)

    def extra_repr(self) -> str:
        return f"scale={self.scale}, causal={self.causal}"
