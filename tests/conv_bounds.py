"""The error bound of a fused convolution + activation against float64, shared by the conv tests.

The pre-activation z = conv(x, w) + b is a sum of R*R*C/groups products in
opmath, so its error is at most sum|x||w| * (product error + (terms + 1) unit
roundoffs), the worst-case bound of a sequential sum; a path that rounds z to
the dtype before the activation (cuDNN, then the activation) adds z's own
rounding, and a bias added after the convolution's rounding one more. The
activation is Lipschitz with constant 1.5 at most (hardswish's slope at 3),
and the output is rounded once more. The reference is float64 on the CPU.
"""

import torch
import torch.nn.functional as F

TORCH_ACT = {None: lambda t: t, "relu": F.relu, "relu6": F.relu6, "hardswish": F.hardswish, "silu": F.silu}
LIPSCHITZ = 1.5
UNIT = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
# A TF32 product: both operands rounded to 10 mantissa bits.
TF32_PRODUCT_ERR = 2.0**-10 + 2.0**-20


def pre_activation(x, w, b, stride, padding, groups):
    """conv(x, w) + b in float64 on the CPU."""
    bb = None if b is None else b.double().cpu()
    return F.conv2d(x.double().cpu(), w.double().cpu(), bb, stride, padding, 1, groups)


def assert_fused_conv_close(out, x, w, b, stride, padding, groups, activation, tf32):
    """out is act(conv(x, w) + b) within the bound above; tf32: the products were TF32."""
    z = pre_activation(x, w, b, stride, padding, groups)
    ref = TORCH_ACT[activation](z)
    assert out.dtype == x.dtype and out.shape == ref.shape
    absb = None if b is None else b.double().cpu().abs()
    absz = F.conv2d(x.double().cpu().abs(), w.double().cpu().abs(), absb, stride, padding, 1, groups)
    opmath = torch.float64 if x.dtype == torch.float64 else torch.float32
    terms = w.shape[1] * w.shape[2] * w.shape[3] + 1
    product = TF32_PRODUCT_ERR if tf32 else 0.0
    z_err = absz * (product + terms * UNIT[opmath] + UNIT[x.dtype]) + z.abs() * UNIT[x.dtype]
    # silu's exp in opmath: a few unit roundoffs of the output besides its rounding.
    bound = LIPSCHITZ * z_err + ref.abs() * (UNIT[x.dtype] + 8 * UNIT[opmath]) + 1e-300
    err = (out.cpu().double() - ref).abs()
    assert not torch.isnan(out).any()
    assert (err <= bound).all(), f"{activation}: max err/bound {(err / bound).max().item():.3f}"
