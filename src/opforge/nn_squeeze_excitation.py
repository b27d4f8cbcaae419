"""``SqueezeExcitation``: a squeeze-and-excitation block as one op call.

It computes what torchvision's ``SqueezeExcitation`` computes, ``x *
scale_activation(fc2(activation(fc1(avgpool(x)))))``, with the same
submodules and parameter names (``fc1.weight``, ``fc2.bias``, ...), so a
``state_dict`` loads either way; its forward is one call of
``opforge.squeeze_excitation`` instead of six module calls.
"""

from __future__ import annotations

import torch

from .nn_prepacked import registered, with_params_of
from .ops.squeeze_excitation import ACTIVATIONS, SCALE_ACTIVATIONS, squeeze_excitation

# torch's activation modules by opforge's names for them.
ACTIVATION_MODULES = {
    "relu": torch.nn.ReLU,
    "relu6": torch.nn.ReLU6,
    "silu": torch.nn.SiLU,
    "hardswish": torch.nn.Hardswish,
    "sigmoid": torch.nn.Sigmoid,
    "hardsigmoid": torch.nn.Hardsigmoid,
}


def activation_name(module: torch.nn.Module, allowed: tuple[str, ...]) -> str | None:
    """opforge's name for an activation module (exactly that class), if it is one of ``allowed``."""
    for name in allowed:
        if type(module) is ACTIVATION_MODULES[name]:
            return name
    return None


class SqueezeExcitation(torch.nn.Module):
    """``x * scale_activation(fc2(activation(fc1(avgpool(x)))))`` as one op call.

    ``fc1`` and ``fc2`` are 1x1 ``nn.Conv2d`` layers (``input_channels ->
    squeeze_channels -> input_channels``); ``activation`` is ``"relu"``,
    ``"relu6"``, ``"silu"`` or ``"hardswish"``, ``scale_activation``
    ``"sigmoid"`` or ``"hardsigmoid"``. It trains (autograd runs through the
    op's ATen kernels); ``torch.compile`` traces those kernels, and
    ``torch.export`` keeps the op as one node (opforge's library runs it;
    ``run_decompositions()`` turns it into the ATen ops)::

        se = torchvision.ops.SqueezeExcitation(64, 16, scale_activation=torch.nn.Hardsigmoid)
        fast = opforge.nn.SqueezeExcitation.from_module(se)
        y = fast(x)   # == se(x)
    """

    def __init__(
        self,
        input_channels: int,
        squeeze_channels: int,
        activation: str = "relu",
        scale_activation: str = "sigmoid",
        device=None,
        dtype=None,
    ):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"SqueezeExcitation: activation must be one of {ACTIVATIONS}, got {activation!r}")
        if scale_activation not in SCALE_ACTIVATIONS:
            raise ValueError(
                f"SqueezeExcitation: scale_activation must be one of {SCALE_ACTIVATIONS}, got {scale_activation!r}"
            )
        self.avgpool = torch.nn.AdaptiveAvgPool2d(1)
        self.fc1 = torch.nn.Conv2d(input_channels, squeeze_channels, 1, device=device, dtype=dtype)
        self.fc2 = torch.nn.Conv2d(squeeze_channels, input_channels, 1, device=device, dtype=dtype)
        self.activation = ACTIVATION_MODULES[activation]()
        self.scale_activation = ACTIVATION_MODULES[scale_activation]()
        self.activation_name, self.scale_activation_name = activation, scale_activation

    @classmethod
    def from_module(cls, se: torch.nn.Module) -> SqueezeExcitation:
        """The block ``se`` (torchvision's ``SqueezeExcitation``, or a module with its ``fc1``, ``fc2``,
        ``activation`` and ``scale_activation``), with copies of its parameters, in its mode."""
        why = why_not_fusable(se)
        if why:
            raise ValueError(f"SqueezeExcitation.from_module: {why}")
        act = activation_name(se.activation, ACTIVATIONS)
        scale = activation_name(se.scale_activation, SCALE_ACTIVATIONS)
        fc1, fc2 = se.fc1, se.fc2
        out = cls(fc1.in_channels, fc1.out_channels, act, scale, device="meta", dtype=fc1.weight.dtype)
        for mine, theirs in ((out.fc1, fc1), (out.fc2, fc2)):
            with_params_of(mine, theirs)
            if theirs.bias is None:
                mine.bias = None
        return out.train(se.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Read from the registries, not through Module.__getattr__: this runs once per call.
        fc1, fc2 = self._modules["fc1"], self._modules["fc2"]
        return squeeze_excitation(
            x,
            registered(fc1, "_parameters", "weight"),
            registered(fc1, "_parameters", "bias"),
            registered(fc2, "_parameters", "weight"),
            registered(fc2, "_parameters", "bias"),
            self.activation_name,
            self.scale_activation_name,
        )


def _is_pointwise(conv) -> bool:
    """A plain 1x1 conv: no stride, padding, dilation or groups, zero padding mode."""
    if type(conv) is not torch.nn.Conv2d or tuple(conv.kernel_size) != (1, 1):
        return False
    plain = tuple(conv.stride) == (1, 1) and tuple(conv.dilation) == (1, 1) and conv.groups == 1
    return plain and conv.padding in ((0, 0), "valid") and conv.padding_mode == "zeros"


def why_not_fusable(se: torch.nn.Module) -> str:
    """Why ``se`` cannot run as this op ("" where it can): its parts must be what the op computes."""
    parts = {name: getattr(se, name, None) for name in ("avgpool", "fc1", "fc2", "activation", "scale_activation")}
    missing = [name for name, m in parts.items() if not isinstance(m, torch.nn.Module)]
    if missing:
        return f"the block has no {', '.join(missing)} module"
    pool = parts["avgpool"]
    if type(pool) is not torch.nn.AdaptiveAvgPool2d or pool.output_size not in (1, (1, 1)):
        return "avgpool must be AdaptiveAvgPool2d(1)"
    fc1, fc2 = parts["fc1"], parts["fc2"]
    if not (_is_pointwise(fc1) and _is_pointwise(fc2)):
        return "fc1 and fc2 must be plain 1x1 Conv2d layers (stride 1, no padding, dilation or groups)"
    if fc2.in_channels != fc1.out_channels or fc2.out_channels != fc1.in_channels:
        return "fc2 must map fc1's outputs back to its inputs' channels"
    if fc1.weight.dtype != fc2.weight.dtype or fc1.weight.device != fc2.weight.device:
        return "fc1 and fc2 must share a dtype and a device"
    if activation_name(parts["activation"], ACTIVATIONS) is None:
        return f"activation {type(parts['activation']).__name__} is not one of ReLU, ReLU6, SiLU, Hardswish"
    if activation_name(parts["scale_activation"], SCALE_ACTIVATIONS) is None:
        return f"scale_activation {type(parts['scale_activation']).__name__} is not Sigmoid or Hardsigmoid"
    return ""
