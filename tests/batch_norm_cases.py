"""Cases and tolerances shared by the batch norm + activation engine tests (conv2d_batch_norm,
batch_norm_act): results are compared with torch's modules run in float64."""

import torch

ACTIVATIONS = {
    None: torch.nn.Identity,
    "relu": torch.nn.ReLU,
    "relu6": torch.nn.ReLU6,
    "hardswish": torch.nn.Hardswish,
    "silu": torch.nn.SiLU,
}
JUMPS = {"relu": (0.0,), "relu6": (0.0, 6.0), "hardswish": (-3.0, 3.0)}
# Error allowed, relative to the largest value compared (at least 1), and how far from a jump of the
# activation's derivative the float64 pre-activation must lie for its gradient to be compared: the
# conv's rounding in the dtype moves the pre-activation by about that much.
TOLERANCE = {torch.float32: 2e-4, torch.float16: 1e-2, torch.bfloat16: 6e-2}
JUMP_WIDTH = {torch.float32: 1e-3, torch.float16: 3e-2, torch.bfloat16: 0.25}
BATCH_NORMS = {
    "affine": dict(),
    "no_affine": dict(affine=False),
    "no_running": dict(track_running_stats=False),
    "float_params": dict(float_params=True),
}


def away_from_jumps_of(z, activation, width):
    """Where the float64 pre-activation z lies farther than width (relative) from a point where the
    activation's derivative jumps: there a gradient computed in a lower precision is comparable."""
    keep = torch.ones_like(z, dtype=torch.bool)
    for point in JUMPS.get(activation, ()):
        keep &= (z - point).abs() > width * max(abs(point), 1.0)
    return keep


def random_batch_norm(channels, bn):
    """A training BatchNorm2d (momentum 0.3) of the BATCH_NORMS setup ``bn`` (its ``float_params``
    removed, returned apart), affine parameters and running statistics random (never 0 / 1)."""
    bn = dict(bn)
    float_params = bn.pop("float_params", False)
    norm = torch.nn.BatchNorm2d(channels, momentum=0.3, **bn).train()
    with torch.no_grad():
        if norm.affine:
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.uniform_(-0.5, 0.5)
        if norm.track_running_stats:
            norm.running_mean.uniform_(-1, 1)
            norm.running_var.uniform_(0.5, 2.0)
    return norm, float_params
