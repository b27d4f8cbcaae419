"""The checks of opforge.conv2d_3x3's values against float64, shared by the conv tests.

Tolerances: each output is a sum of 9*C/groups products plus the bias. With
results accumulated in opmath (float32 for the half types, TF32 for float32
dense on CUDA when allowed) and rounded once, the error is the output's
rounding (reference.TOLERANCES) plus an accumulation error that grows like
sqrt(9*C/groups) unit roundoffs of the typical term size (inputs are N(0, 1),
so terms are O(1) and the sum O(sqrt(9C))). The absolute tolerance is
therefore the dtype's atol scaled by sqrt(9*C/groups) (`scale_for`), never a
fixed loose number; the reference is float64 F.conv2d on the CPU.
"""

import math

import torch
import torch.nn.functional as F
from reference import TOLERANCES, poisoned

import opforge

# float32 on CUDA may use TF32 (dense path, like F.conv2d): both operands are
# rounded to a 10-bit mantissa, so each product is off by up to ~2^-10
# relative, and the fp32 sum of 9*C of them adds up to 9*C * 2^-23 more. The
# bound below is that worst case over |x| * |w| (not a flat tolerance).
TF32_PRODUCT_ERR = 2.0**-10 + 2.0**-20
# Without TF32 each float32 product is rounded once (2^-24 relative) and the
# same worst-case sum bound applies: a cuDNN float32 algorithm's error on a
# 576-term output is not bounded by a per-element tolerance sized for a few
# terms of magnitude 1.
FP32_PRODUCT_ERR = 2.0**-24
# Gradients through cuDNN's TF32 backward (few terms per output here): a
# per-dtype style tolerance, scaled by sqrt(terms) where it is used.
TF32_TOL = (1e-3, 1e-3)


def assert_within_tf32_bound(out, x, w, b, stride, padding, groups, relu, product_err=TF32_PRODUCT_ERR):
    ref = reference(x, w, b, stride, padding, groups, relu)
    absb = None if b is None else b.double().cpu().abs()
    absref = F.conv2d(x.double().cpu().abs(), w.double().cpu().abs(), absb, stride, padding, 1, groups)
    bound = absref * (product_err + 9 * w.shape[1] * 2.0**-23) + ref.abs() * 2.0**-24 + 1e-30
    err = (out.cpu().double() - ref).abs()
    assert not torch.isnan(out).any()
    assert (err <= bound).all(), f"max err/bound {(err / bound).max().item():.3f}"


def reference(x, w, b, stride, padding, groups, relu):
    y = F.conv2d(
        x.double().cpu(), w.double().cpu(), None if b is None else b.double().cpu(), stride, padding, 1, groups
    )
    return torch.relu(y) if relu else y


def scale_for(c_per_group):
    return math.sqrt(9 * c_per_group)


def reduction_atol(dtype, terms):
    """Absolute tolerance of a sum of `terms` O(1) products (weight and bias
    gradients): the dtype's tolerance scaled like the other sums, plus the
    rounding of the accumulation itself. Summed one after another in opmath
    (unit roundoff u: float32 for every type but float64), the partial sums
    grow like sqrt(k) and their roundings add up to about terms * u / sqrt(2)
    (torch's own float32 CPU backward is off by 3-4e-4 at 7140 terms);
    four times that."""
    u = 2.0**-53 if dtype == torch.float64 else 2.0**-24
    return TOLERANCES[dtype][0] * math.sqrt(terms) + 4 * terms * u


def check(x, w, b, stride, padding, groups, relu):
    with poisoned(x.device):
        out = opforge.conv2d_3x3(x, w, b, stride, padding, groups, "relu" if relu else None)
    ref = reference(x, w, b, stride, padding, groups, relu)
    assert out.dtype == x.dtype and out.device == x.device
    assert out.shape == ref.shape, (out.shape, ref.shape)
    fmt = (
        torch.channels_last
        if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
        else torch.contiguous_format
    )
    assert out.is_contiguous(memory_format=fmt), (out.stride(), fmt)
    if x.dtype == torch.float32 and x.device.type == "cuda" and groups == 1 and torch.backends.cudnn.allow_tf32:
        assert_within_tf32_bound(out, x, w, b, stride, padding, groups, relu)
        return out
    atol, rtol = TOLERANCES[x.dtype]
    scale = scale_for(w.shape[1])
    # Per element, the accumulation error also scales with that output's own
    # sum |x||w| (inputs that happen to be large there): sqrt(terms) roundings
    # of the accumulating type, four standard deviations. torch's F.conv2d
    # needs the same term on such outputs.
    absb = None if b is None else b.double().cpu().abs()
    absref = F.conv2d(x.double().cpu().abs(), w.double().cpu().abs(), absb, stride, padding, 1, groups)
    u = 2.0**-53 if x.dtype == torch.float64 else 2.0**-24
    accumulation = 4 * math.sqrt(9 * w.shape[1] + 1) * u * absref
    err = (out.cpu().double() - ref).abs()
    bound = atol * scale + rtol * ref.abs() + accumulation
    assert not torch.isnan(out).any(), "NaN in the output"
    assert (err <= bound).all(), f"max err {err.max().item():.3g}, max err/bound {(err / bound).max().item():.3f}"
    return out


CONFIGS = [(s, p) for s in (1, 2) for p in (0, 1)]
