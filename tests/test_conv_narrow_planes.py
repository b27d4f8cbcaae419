"""Depthwise backward of NCHW layers with narrow output planes (at most 7 columns).

On the CPU these run the channels_last loops on transposed copies of x, grad_out and
the ReLU result, and grad x is transposed back: every dtype, both strides, the mask,
an unbatched x, a strided x, a single channel, and grad x in NCHW as x was.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from cpu_isa import run_capped
from reference import DTYPES, TOLERANCES, poisoned, rand

import opforge

# (N, C, H, W, stride, padding): outputs of 7, 5, 3 and 1 columns; C = 1 and C = 5 (no full vector).
SHAPES = [
    (2, 5, 7, 7, 1, 1),
    (3, 17, 7, 9, 1, 0),
    (2, 33, 13, 13, 2, 1),
    (1, 1, 7, 7, 1, 1),
    (2, 6, 3, 3, 2, 0),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "N{}_C{}_{}x{}_s{}_p{}".format(*s))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", [None, "relu"])
def test_narrow_nchw_planes_backward(shape, dtype, activation, device):
    n, c, h, w, stride, padding = shape
    x = rand((n, c, h, w), dtype, device)
    wt, b = rand((c, 1, 3, 3), dtype, device), rand((c,), dtype, device)
    x1, w1, b1 = (t.detach().clone().requires_grad_() for t in (x, wt, b))
    out = opforge.conv2d_3x3(x1, w1, b1, stride, padding, c, activation)
    g = rand(out.shape, dtype, device)
    with poisoned(device):
        out.backward(g)
    assert x1.grad.is_contiguous() and x1.grad.shape == x.shape
    # The mask is our own output's (> 0): a float64 pre-activation can sit on the other side of 0.
    mask = (out.detach() > 0).double().cpu() if activation == "relu" else 1.0
    x2, w2, b2 = (t.detach().double().cpu().requires_grad_() for t in (x, wt, b))
    F.conv2d(x2, w2, b2, stride, padding, 1, c).backward(g.double().cpu() * mask)
    atol, rtol = TOLERANCES[dtype]
    terms = n * out.shape[2] * out.shape[3]
    for ours, theirs, k in ((x1.grad, x2.grad, 9), (w1.grad, w2.grad, terms), (b1.grad, b2.grad, terms)):
        assert ours.dtype == dtype
        torch.testing.assert_close(ours.cpu().double(), theirs, atol=atol * math.sqrt(k), rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("view", ["unbatched", "strided"])
def test_narrow_planes_unbatched_and_strided_x(dtype, view, device):
    c = 24
    pick = {"unbatched": lambda t: t[0, :, :, :7], "strided": lambda t: t[:, :, :, ::2]}[view]
    base = rand((2, c, 7, 14), dtype, device)
    wt = rand((c, 1, 3, 3), dtype, device)
    leaf, w1 = base.detach().clone().requires_grad_(), wt.detach().clone().requires_grad_()
    x = pick(leaf)
    assert not x.is_contiguous()
    out = opforge.conv2d_3x3(x, w1, None, 1, 1, c, "relu")
    g = rand(out.shape, dtype, device)
    out.backward(g)
    leaf2, w2 = base.detach().double().cpu().requires_grad_(), wt.detach().double().cpu().requires_grad_()
    mask = (out.detach() > 0).double().cpu()
    F.conv2d(pick(leaf2), w2, None, 1, 1, 1, c).backward(g.double().cpu() * mask)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(leaf.grad.cpu().double(), leaf2.grad, atol=atol * 3, rtol=rtol)
    torch.testing.assert_close(w1.grad.cpu().double(), w2.grad, atol=atol * 10, rtol=rtol)


@pytest.mark.parametrize("capability", ["default", "avx2", "avx512"])
def test_narrow_planes_every_cpu_isa(capability):
    """The transposes are separate machine code per ISA (register tiles where the ISA has them):
    the narrow-plane backward and the bfloat16 forward over 1536 planes of 7 and 14 columns,
    each against float64, with torch's CPU capability capped."""
    code = """
import math, torch, torch.nn.functional as F, opforge
tols = {torch.float32: 1e-5, torch.float64: 1e-12, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
for dtype, atol in tols.items():
    for n, c, hw, s in ((2, 40, 7, 1), (3, 5, 13, 2), (2, 17, 9, 1)):
        x = torch.randn(n, c, hw, hw, dtype=torch.float64).to(dtype)
        w = torch.randn(c, 1, 3, 3, dtype=torch.float64).to(dtype)
        y = opforge.conv2d_3x3(x, w, None, s, 1, c, "relu")
        g = torch.randn(y.shape, dtype=torch.float64).to(dtype)
        ours = torch.ops.opforge._conv2d_3x3_backward(g, y, x, w, s, 1, c, [True, True, False])
        assert ours[0].is_contiguous()
        xd, wd = (t.double().requires_grad_() for t in (x, w))
        F.conv2d(xd, wd, None, s, 1, 1, c).backward(g.double() * (y.double() > 0))
        terms = n * y.shape[2] * y.shape[3]
        for o, r, k in ((ours[0], xd.grad, 9), (ours[1], wd.grad, terms)):
            err = (o.double() - r).abs().max().item()
            tol = atol * math.sqrt(k) * 2 + 2.0**-8 * r.abs().max().item() * (dtype == torch.bfloat16)
            assert err <= tol, (dtype, n, c, hw, s, err, tol)
for hw in (7, 14):
    x = torch.randn(4, 384, hw, hw, dtype=torch.float64)
    w, b = torch.randn(384, 1, 3, 3, dtype=torch.float64), torch.randn(384, dtype=torch.float64)
    y = opforge.conv2d_3x3(x.bfloat16(), w.bfloat16(), b.bfloat16(), 1, 1, 384, "relu")
    ref = F.relu(F.conv2d(x.bfloat16().double(), w.bfloat16().double(), b.bfloat16().double(), 1, 1, 1, 384))
    assert y.is_contiguous() and y.dtype == torch.bfloat16
    err = (y.double() - ref).abs().max().item()
    assert err <= 2.0**-8 * ref.abs().max().item() * 2, (hw, err)
print("ok")
"""
    run_capped(capability, code)
