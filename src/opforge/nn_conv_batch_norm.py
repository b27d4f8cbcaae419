"""``ConvBatchNorm2d``: a training-mode ``Conv2d -> BatchNorm2d -> activation`` as one op call.

``opforge.optimize`` puts one where a model trains through such a chain. The
conv keeps its place and parameter names (it is an ``nn.Conv2d``); the
BatchNorm keeps its place, parameters and buffers as a
:class:`BatchNormInConv` (a ``BatchNorm2d`` whose forward passes its input
on, since the conv before it applies it); the activation's place holds an
``nn.Identity``. So ``state_dict`` keys, optimizers' parameters and
checkpoints are the original model's.

``BatchNormAct2d``: a training-mode ``BatchNorm2d -> activation`` as one op
call (``opforge.batch_norm_act``), what ``optimize`` puts after opforge's
own conv; it is the BatchNorm (same names), the activation's place holds an
``nn.Identity``.
"""

from __future__ import annotations

import torch

from .nn_prepacked import registered
from .ops.conv import TORCH_ACTIVATIONS
from .ops.conv_batch_norm import _batch_norm_act, _conv2d_batch_norm


def _recast(module: torch.nn.Module, cls: type) -> torch.nn.Module:
    """A ``cls`` (a subclass of module's class) holding module's attributes, parameters and buffers:
    the same tensors under the same names, in registries of its own."""
    out = cls.__new__(cls)
    out.__dict__.update(module.__dict__)
    for store in ("_parameters", "_buffers", "_modules"):
        out.__dict__[store] = dict(module.__dict__[store])
    return out


def _check_activation(where: str, activation: str | None) -> None:
    if activation not in TORCH_ACTIVATIONS:
        names = "None, 'relu', 'relu6', 'hardswish' or 'silu'"
        raise ValueError(f"{where}: activation must be {names}, got {activation!r}")


class BatchNormInConv(torch.nn.BatchNorm2d):
    """A ``BatchNorm2d`` applied by the :class:`ConvBatchNorm2d` before it: its forward is the identity.

    It holds the statistics and affine parameters that conv reads and
    updates, under the BatchNorm's own names."""

    @classmethod
    def of(cls, bn: torch.nn.BatchNorm2d) -> BatchNormInConv:
        """``bn``'s parameters and buffers (the same tensors) in a module of this class."""
        return _recast(bn, cls)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class ConvBatchNorm2d(torch.nn.Conv2d):
    """``activation(batch_norm(conv2d(x)) [+ residual])`` with the BatchNorm held by a :class:`BatchNormInConv`.

    ``forward(x, residual=None)``: the residual, when given, is added before
    the activation (a residual block's tail, ``relu(bn(conv(x)) +
    shortcut)``, which ``opforge.optimize`` rewrites into one call).

    Where the BatchNorm uses batch statistics (training mode, or no running
    statistics) and its momentum is a number, the forward is one call of
    ``opforge.conv2d_batch_norm``: ATen's convolution, then opforge's batch
    norm + activation engine where it takes the conv output (CPU float32 and
    half types, CUDA channels_last; values, gradients and running statistics
    within a rounding of torch's layers), else ATen's batch norm and
    activation kernels (equal to torch's layers); one autograd node. Elsewhere (eval mode, a cumulative
    average with ``momentum=None``, ``padding_mode`` other than zeros, a
    string padding, an unbatched input, under autocast, and while
    ``torch.compile`` or export traces it) it runs the three as torch's
    modules do.

    >>> import copy, torch, opforge
    >>> conv, bn = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8)
    >>> fused = opforge.nn.ConvBatchNorm2d.of(conv, opforge.nn.BatchNormInConv.of(bn), "relu")
    >>> x = torch.randn(2, 3, 8, 8)
    >>> reference = torch.relu(copy.deepcopy(bn)(conv(x)))  # the modules, on a copy of the statistics
    >>> torch.allclose(fused(x), reference, atol=1e-5)
    True
    """

    activation: str | None

    @classmethod
    def of(cls, conv: torch.nn.Conv2d, batch_norm: BatchNormInConv, activation: str | None = None) -> ConvBatchNorm2d:
        """``conv`` (the same parameters) followed by ``batch_norm`` and ``activation`` (None, ``"relu"``,
        ``"relu6"``, ``"hardswish"``, ``"silu"``)."""
        if type(conv) is not torch.nn.Conv2d:
            raise TypeError(f"ConvBatchNorm2d.of: conv must be a torch.nn.Conv2d, got {type(conv).__name__}")
        if not isinstance(batch_norm, BatchNormInConv):
            raise TypeError(
                f"ConvBatchNorm2d.of: batch_norm must be an opforge.nn.BatchNormInConv (BatchNormInConv.of(bn)), "
                f"got {type(batch_norm).__name__}"
            )
        _check_activation("ConvBatchNorm2d.of", activation)
        out = _recast(conv, cls)
        out.activation = activation
        # Not a submodule: the BatchNorm is registered where it was, so its state keeps its names.
        object.__setattr__(out, "batch_norm", batch_norm)
        return out

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        bn = self.batch_norm
        running_mean = registered(bn, "_buffers", "running_mean")
        running_var = registered(bn, "_buffers", "running_var")
        if (
            (bn.training or running_mean is None)
            and bn.momentum is not None
            and self.padding_mode == "zeros"
            and not isinstance(self.padding, str)
            and x.dim() == 4
            and not torch.compiler.is_compiling()
            and not torch.is_autocast_enabled(x.device.type)
            and (residual is None or self._adds_in_op(x, residual))
        ):
            # Each module's tensors read once, from its registries (not through Module.__getattr__):
            # this runs per call of every chain.
            tracked = bn.training and bn.track_running_stats
            if bn.training and not bn.track_running_stats:
                running_mean = running_var = None
            return _conv2d_batch_norm(
                x,
                registered(self, "_parameters", "weight"),
                registered(self, "_parameters", "bias"),
                registered(bn, "_parameters", "weight"),
                registered(bn, "_parameters", "bias"),
                running_mean,
                running_var,
                registered(bn, "_buffers", "num_batches_tracked") if tracked else None,
                self.stride,
                self.padding,
                self.dilation,
                self.groups,
                bn.momentum,
                bn.eps,
                self.activation,
                residual,
            )
        y = torch.nn.BatchNorm2d.forward(bn, self._conv_forward(x, self.weight, self.bias))
        if residual is not None:
            y = y + residual
        act = TORCH_ACTIVATIONS[self.activation]
        return y if act is None else act(y)

    def _adds_in_op(self, x: torch.Tensor, residual) -> bool:
        """Whether the op takes ``residual`` as the block's modules would add it: a tensor of the conv
        output's shape, dtype and device (the modules also broadcast and promote; the op does not)."""
        if not isinstance(residual, torch.Tensor) or residual.dtype != x.dtype or residual.device != x.device:
            return False
        size = [x.shape[0], self.out_channels]
        for i in (0, 1):
            reach = self.dilation[i] * (self.kernel_size[i] - 1) + 1
            size.append((x.shape[2 + i] + 2 * self.padding[i] - reach) // self.stride[i] + 1)
        return list(residual.shape) == size

    def extra_repr(self) -> str:
        return super().extra_repr() + f", batch_norm=({self.batch_norm.extra_repr()}), activation={self.activation!r}"


class BatchNormAct2d(torch.nn.BatchNorm2d):
    """A ``BatchNorm2d`` followed by an activation (None, ``"relu"``, ``"relu6"``, ``"hardswish"``,
    ``"silu"``), as one call of ``opforge.batch_norm_act`` where it uses batch statistics.

    ``opforge.optimize`` puts one after opforge's own conv in a training
    chain (``conv2d_batch_norm`` fuses ATen's conv instead). It holds the
    BatchNorm's parameters and buffers (the same tensors, under the same
    names); the activation's place holds an ``nn.Identity``. Where the
    statistics are the running ones (eval mode), with ``momentum=None``, an
    input that is not 4-d, under autocast and while ``torch.compile`` or
    export traces it, it runs as ``BatchNorm2d`` then the activation.

    >>> import copy, torch, opforge
    >>> bn = torch.nn.BatchNorm2d(8)
    >>> fused = opforge.nn.BatchNormAct2d.of(copy.deepcopy(bn), "relu6")
    >>> x = torch.randn(2, 8, 5, 5)
    >>> torch.allclose(fused(x), torch.nn.functional.relu6(bn(x)), atol=1e-5)
    True
    """

    activation: str | None

    @classmethod
    def of(cls, bn: torch.nn.BatchNorm2d, activation: str | None = None) -> BatchNormAct2d:
        """``bn`` (its parameters and buffers, the same tensors) followed by ``activation``."""
        if not isinstance(bn, torch.nn.BatchNorm2d):
            raise TypeError(f"BatchNormAct2d.of: bn must be a torch.nn.BatchNorm2d, got {type(bn).__name__}")
        _check_activation("BatchNormAct2d.of", activation)
        out = _recast(bn, cls)
        out.activation = activation
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        running_mean = registered(self, "_buffers", "running_mean")
        if (
            (self.training or running_mean is None)
            and self.momentum is not None
            and x.dim() == 4
            and not torch.compiler.is_compiling()
            and not torch.is_autocast_enabled(x.device.type)
        ):
            tracked = self.training and self.track_running_stats
            running_var = registered(self, "_buffers", "running_var") if tracked else None
            return _batch_norm_act(
                x,
                registered(self, "_parameters", "weight"),
                registered(self, "_parameters", "bias"),
                running_mean if tracked else None,
                running_var,
                registered(self, "_buffers", "num_batches_tracked") if tracked else None,
                self.momentum,
                self.eps,
                self.activation,
            )
        y = super().forward(x)
        act = TORCH_ACTIVATIONS[self.activation]
        return y if act is None else act(y)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", activation={self.activation!r}"
