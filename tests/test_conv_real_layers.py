"""conv2d_3x3 on depthwise layer shapes of real models, forward and backward, against float64.

The shapes are ones tools/depthwise_sweep.py collects from torchvision's
classification models: the ones whose staged weight-gradient plan fills its
48 KiB stage exactly (64 planes of 14x14 in bfloat16), which with the
kernel's static reduction scratch needs the shared-memory opt-in; and
stride-2 and small-plane layers, whose forward takes the unstaged kernels
and whose backward at stride 2 from 2^21 (NCHW) or 2^22 (NHWC) input
elements is cuDNN's after the fused mask and bias pass.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from reference import TOLERANCES, poisoned, rand

import opforge

pytestmark = pytest.mark.cuda

# (N, C, H, W, stride): mobilenet_v3_large / efficientnet_b0 / mnasnet1_0 (C480),
# mobilenet_v2 / mnasnet1_0 (C576), mobilenet_v3_large (C672); and neighbours.
SHAPES = [(64, 480, 14, 14, 1), (64, 576, 14, 14, 1), (64, 672, 14, 14, 1), (64, 384, 14, 14, 1), (8, 960, 7, 7, 1)]
# mobilenet_v2 (C576 14x14 and C144 56x56, stride 2), shufflenet_v2 (C58, stride 2: no 4-channel vectors),
# mobilenet_v3_large (C960 7x7).
SHAPES += [(64, 576, 14, 14, 2), (8, 144, 56, 56, 2), (64, 58, 56, 56, 2), (64, 960, 7, 7, 1)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "N{}_C{}_{}x{}_s{}".format(*s))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("channels_last", [False, True])
def test_depthwise_backward_real_layers(shape, dtype, channels_last):
    n, c, h, w, s = shape
    x = rand((n, c, h, w), dtype, "cuda")
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    wt, b = rand((c, 1, 3, 3), dtype, "cuda"), rand((c,), dtype, "cuda")
    x1, w1, b1 = (t.detach().clone().requires_grad_() for t in (x, wt, b))
    out = opforge.conv2d_3x3(x1, w1, b1, s, 1, c, "relu6")
    g = rand(out.shape, dtype, "cuda")
    with poisoned("cuda"):
        out.backward(g)
    y = out.detach().double()
    x2, w2, b2 = (t.detach().double().requires_grad_() for t in (x, wt, b))
    ref = F.conv2d(x2, w2, b2, s, 1, 1, c)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(y, F.relu6(ref.detach()), atol=atol * 3, rtol=rtol)
    ref.backward(g.double() * ((y > 0) & (y < 6)).double())
    for ours, theirs, terms in ((x1.grad, x2.grad, 9), (w1.grad, w2.grad, n * h * w), (b1.grad, b2.grad, n * h * w)):
        torch.testing.assert_close(ours.double(), theirs, atol=atol * math.sqrt(terms), rtol=rtol)
