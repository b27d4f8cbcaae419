"""Bench cases of the conv family: conv2d_3x3 (+ fused bias/ReLU) against F.conv2d (+ relu).

Depthwise 3x3 is memory-bound: its floor is reading x once and writing the
output once, 2*N*C*H*W*s bytes (stride 1, padding 1, multiplier 1; weights
and bias add K*10*s). Dense 3x3 is compute-bound: 2*N*K*C*9*Ho*Wo FLOPs,
reported as TFLOP/s (compare with the device's matrix rate).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import opforge

from ..case import BenchCase, register


def _eager(groups: int, relu: bool, padding: int = 1, stride: int = 1):
    def fn(x, w, b):
        y = F.conv2d(x, w, b, stride, padding, 1, groups)
        return torch.relu(y) if relu else y

    fn.__name__ = "F.conv2d+relu" if relu else "F.conv2d"
    return fn


def _reference(groups: int, relu: bool, padding: int = 1, stride: int = 1):
    """The float64 result every provider is checked against (half-type
    outputs of two implementations can each be within rounding of it and still
    differ from each other by more than a tolerance on millions of outputs)."""

    def fn(x, w, b):
        y = F.conv2d(x.double(), w.double(), b.double(), stride, padding, 1, groups)
        return torch.relu(y) if relu else y

    return fn


def _ours(groups: int, relu: bool, padding: int = 1, stride: int = 1):
    def fn(x, w, b):
        return opforge.conv2d_3x3(x, w, b, stride, padding, groups, "relu" if relu else None)

    return fn


def _inputs(n, c, h, w, k, groups, dtype, device, channels_last):
    def make():
        x = torch.randn(n, c, h, w, device=device, dtype=dtype)
        if channels_last:
            x = x.to(memory_format=torch.channels_last)
        return [
            x,
            torch.randn(k, c // groups, 3, 3, device=device, dtype=dtype) * (9 * c // groups) ** -0.5,
            torch.randn(k, device=device, dtype=dtype),
        ]

    return make


def _depthwise_case(n, c, h, w, dtype, device, channels_last, stride, quick):
    """Depthwise 3x3 + bias + ReLU, padding 1. Floor: read x and write the
    output once (stride 2: a quarter of x's size); backward: read grad_out
    and the result, read x, write grad x (weights negligible)."""
    s = torch.empty((), dtype=dtype).element_size()
    fmt = "NHWC" if channels_last else "NCHW"
    out_elems = n * c * ((h - 1) // stride + 1) * ((w - 1) // stride + 1)
    return BenchCase(
        op="conv2d_3x3_depthwise_relu",
        label=f"N{n} C{c} {h}x{w} {fmt}" + (f" stride {stride}" if stride != 1 else ""),
        dtype=dtype,
        make_inputs=_inputs(n, c, h, w, c, c, dtype, device, channels_last),
        ours=_ours(c, True, stride=stride),
        eager=_eager(c, True, stride=stride),
        eager_name="F.conv2d+relu",
        reference=_reference(c, True, stride=stride),
        bytes_fwd=(n * c * h * w + out_elems) * s + 10 * c * s,
        bytes_bwd=(2 * n * c * h * w + 2 * out_elems) * s,
        grad_inputs=(0, 1, 2),
        atol=1e-2 if dtype == torch.bfloat16 else 1e-4,
        rtol=1e-2 if dtype == torch.bfloat16 else 1e-4,
        # weight and bias gradients sum N x Ho x Wo terms each
        grad_atol={i: (1e-2 if dtype == torch.bfloat16 else 1e-4) * math.sqrt(out_elems / c) for i in (1, 2)},
        relu_output=True,
        quick=quick,
    )


@register("conv")
def cases(device: str) -> list[BenchCase]:
    out = []
    if device == "cuda":
        dw_shapes = [(32, 64, 56, 56), (8, 256, 28, 28), (64, 128, 112, 112)]
        dense_shapes = [(32, 64, 56, 56, 64), (8, 256, 28, 28, 256), (16, 128, 56, 56, 128)]
        dtypes = (torch.bfloat16, torch.float32)
    else:
        dw_shapes = [(4, 64, 56, 56), (2, 256, 28, 28)]
        dense_shapes = [(1, 64, 56, 56, 64), (2, 128, 28, 28, 128)]
        dtypes = (torch.float32,)
    for dtype in dtypes:
        for channels_last in (False, True):
            for i, (n, c, h, w) in enumerate(dw_shapes):
                out.append(_depthwise_case(n, c, h, w, dtype, device, channels_last, 1, i == 0 and not channels_last))
        if device == "cpu":
            # Stride 2 (the downsampling layers of mobile networks), NCHW.
            for n, c, h, w in dw_shapes:
                out.append(_depthwise_case(n, c, h, w, dtype, device, False, 2, False))
        for i, (n, c, h, w, k) in enumerate(dense_shapes):
            flops = 2 * n * k * c * 9 * h * w  # padding 1, stride 1: Ho, Wo = H, W
            out.append(
                BenchCase(
                    op="conv2d_3x3_dense_relu",
                    label=f"N{n} C{c} {h}x{w} K{k}",
                    dtype=dtype,
                    make_inputs=_inputs(n, c, h, w, k, 1, dtype, device, dtype == torch.bfloat16 and device == "cuda"),
                    ours=_ours(1, True),
                    eager=_eager(1, True),
                    eager_name="F.conv2d+relu",
                    flops_fwd=float(flops),
                    grad_inputs=(0, 1, 2),
                    # TF32 on both sides for float32 on CUDA (allow_tf32 is followed)
                    atol=5e-2 if dtype == torch.bfloat16 else 1e-2,
                    rtol=5e-2 if dtype == torch.bfloat16 else 1e-2,
                    relu_output=True,
                    quick=i == 0,
                )
            )
    return out
