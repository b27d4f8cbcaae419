"""Bench cases of the softmax family: softmax against eager ``torch.softmax``
(and its compiled form), and scaled_masked_softmax against the eager
attention composition ``softmax(x * scale + mask)``.

Bytes: forward reads x and writes y (2 M K s); backward reads grad and y and
writes grad_in (3 M K s). The causal case's floor counts the whole tensor,
as eager must, although the fused kernel skips reading masked keys.
"""

from __future__ import annotations

import torch

import opforge

from ..case import BenchCase, register

GPU_SHAPES = [(8192, 1024), (8192, 8192), (4096, 32768), (65536, 128), (512, 262144)]
CPU_SHAPES = [(1024, 8192), (65536, 128)]


def eager_softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x, -1)


def causal_additive_mask(lq: int, lk: int, dtype: torch.dtype, device) -> torch.Tensor:
    return torch.zeros((lq, lk), dtype=dtype, device=device).masked_fill(
        torch.ones((lq, lk), dtype=torch.bool, device=device).triu(1), float("-inf")
    )


@register("softmax")
def cases(device: str) -> list[BenchCase]:
    out = []
    shapes = GPU_SHAPES if device == "cuda" else CPU_SHAPES
    for dtype in (torch.float32, torch.bfloat16):
        s = torch.empty((), dtype=dtype).element_size()
        for m, k in shapes:
            out.append(
                BenchCase(
                    op="softmax",
                    label=f"{m}x{k}",
                    dtype=dtype,
                    make_inputs=lambda m=m, k=k, dtype=dtype: [torch.randn((m, k), device=device, dtype=dtype)],
                    ours=opforge.softmax,
                    eager=eager_softmax,
                    eager_name="torch.softmax",
                    bytes_fwd=2 * m * k * s,
                    bytes_bwd=3 * m * k * s,  # read grad and y, write grad_in
                    grad_inputs=(0,),
                    quick=(m, k) in ((8192, 8192), (1024, 8192)),
                )
            )

    # Attention scores with a causal mask: ours builds the mask on the fly,
    # eager adds a materialised additive mask.
    b, h, lq = (32, 16, 2048) if device == "cuda" else (2, 4, 512)
    lk = lq
    scale = 0.125
    for dtype in (torch.bfloat16,) if device == "cuda" else (torch.float32, torch.bfloat16):
        s = torch.empty((), dtype=dtype).element_size()
        n = b * h * lq * lk

        def make(dtype=dtype):
            x = torch.randn((b, h, lq, lk), device=device, dtype=dtype)
            return [x, causal_additive_mask(lq, lk, dtype, device)]

        out.append(
            BenchCase(
                op="scaled_masked_softmax",
                label=f"causal {b}x{h}x{lq}x{lk}",
                dtype=dtype,
                make_inputs=make,
                ours=lambda x, mask: opforge.scaled_masked_softmax(x, None, scale, True),
                eager=lambda x, mask: torch.softmax(x * scale + mask, -1),
                eager_name="softmax(x*scale+mask)",
                bytes_fwd=2 * n * s,
                bytes_bwd=3 * n * s,
                grad_inputs=(0,),
                quick=True,
            )
        )
    return out
