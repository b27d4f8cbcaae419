"""Helpers shared by the op tests: fresh inputs, float64 references,
per-dtype tolerances, and poisoned output memory."""

from __future__ import annotations

import contextlib

import torch

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]

# (atol, rtol) for results computed in opmath and rounded once; NaN never
# passes unless the reference has NaN in the same place and the test says so.
TOLERANCES = {
    torch.float64: (1e-12, 1e-10),
    torch.float32: (1e-6, 1e-5),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1e-2, 1e-2),
}


def rand(shape, dtype=torch.float32, device="cpu", scale=1.0) -> torch.Tensor:
    """Fresh standard-normal values (never zeros, never a fixed seed)."""
    return (torch.randn(shape, dtype=torch.float64, device=device) * scale).to(dtype)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype=None, equal_nan=False, scale=1.0, rtol_scale=1.0):
    dtype = dtype or actual.dtype
    atol, rtol = TOLERANCES[dtype]
    rtol *= rtol_scale
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    torch.testing.assert_close(actual, expected, atol=atol * scale, rtol=rtol, equal_nan=equal_nan)


@contextlib.contextmanager
def poisoned(device="cpu"):
    """Uninitialised memory handed to kernels is NaN inside this block.

    torch's deterministic mode fills every fresh `empty` with NaN, on the CPU
    and the GPU, so an output element a kernel forgot to write shows up as
    NaN and fails the comparison. On CUDA the caching allocator's free blocks
    are also filled first, for allocations that skip that path.
    """
    if device == "cuda" or (isinstance(device, torch.device) and device.type == "cuda"):
        junk = torch.full((64 << 20,), float("nan"), device=device)
        del junk
    old = torch.are_deterministic_algorithms_enabled()
    old_fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(old)
        torch.utils.deterministic.fill_uninitialized_memory = old_fill
