"""Bench cases of the add family: add_relu against the seeds' slow_add."""

from __future__ import annotations

import torch

import opforge

from ..case import BenchCase, register


def slow_add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The seeds' composition: three kernels in eager PyTorch."""
    z = x + y
    mask = z > 0
    return z * mask.to(z.dtype)


@register("add_relu")
def cases(device: str) -> list[BenchCase]:
    exps = (20, 24, 28) if device == "cuda" else (20, 24)
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        for e in exps:
            n = 1 << e
            s = torch.empty((), dtype=dtype).element_size()
            out.append(
                BenchCase(
                    op="add_relu",
                    label=f"N=2^{e}",
                    dtype=dtype,
                    make_inputs=lambda n=n, dtype=dtype: [
                        torch.randn(n, device=device, dtype=dtype),
                        torch.randn(n, device=device, dtype=dtype),
                    ],
                    ours=opforge.add_relu,
                    eager=slow_add,
                    eager_name="slow_add",
                    bytes_fwd=3 * n * s,
                    bytes_bwd=3 * n * s,  # read grad and result, write grad_in
                    grad_inputs=(0, 1),
                    quick=e in (20, 24),
                )
            )
    return out
