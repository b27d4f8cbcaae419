"""Argument checks shared by the Python wrappers and the fake kernels.

The C++ kernels check the same things with the same words (csrc's
TORCH_CHECK_TYPE / TORCH_CHECK_VALUE); checking here first gives the error at
the user's call site, also under torch.compile where only fake tensors exist.
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def tensor_arg(op: str, name: str, value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def float_tensor(op: str, name: str, value) -> torch.Tensor:
    t = tensor_arg(op, name, value)
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: {name} must be a float32, float64, float16 or bfloat16 tensor, got {t.dtype}")
    return t


def same_device(op: str, a_name: str, a: torch.Tensor, b_name: str, b: torch.Tensor) -> None:
    if a.device != b.device:
        raise ValueError(
            f"{op}: {a_name} and {b_name} must be on the same device, got {a_name} on {a.device} "
            f"and {b_name} on {b.device}"
        )


def companion(op: str, name: str, value, ref_name: str, ref: torch.Tensor) -> torch.Tensor:
    """A float tensor that goes with ``ref``: same device and dtype."""
    t = float_tensor(op, name, value)
    same_device(op, ref_name, ref, name, t)
    if t.dtype != ref.dtype:
        raise TypeError(f"{op}: {name} must have {ref_name}'s dtype {ref.dtype}, got {t.dtype}")
    return t


def broadcast_shape(op: str, a_name: str, a: torch.Tensor, b_name: str, b: torch.Tensor) -> torch.Size:
    ndim = max(a.dim(), b.dim())
    for i in range(1, ndim + 1):
        sa = a.shape[-i] if i <= a.dim() else 1
        sb = b.shape[-i] if i <= b.dim() else 1
        if not (sa == sb or sa == 1 or sb == 1):
            raise ValueError(
                f"{op}: {a_name} with shape {list(a.shape)} and {b_name} with shape {list(b.shape)} "
                f"are not broadcastable (dimension {ndim - i}: {sa} vs {sb})"
            )
    return torch.broadcast_shapes(a.shape, b.shape)
