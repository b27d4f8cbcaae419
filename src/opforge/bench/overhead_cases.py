"""What ``opforge bench overhead`` compares: every public op on a tiny input,
next to the torch code it replaces.

The inputs are small enough (16 elements, a 1x4x8x8 image, 16 boxes) that
the kernel's work is a small part of a call; what remains is the host's cost
of getting there, which is what an eager model of many small layers waits
for. This module imports nothing that loads opforge's kernels at import time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F

# The boxes' image side in px: with widths in [4, 32] px, 16 boxes overlap
# enough that NMS suppresses some of them.
_BOX_IMAGE = 48.0


@dataclasses.dataclass
class OverheadCase:
    op: str  # the public op as users call it, e.g. "conv2d_3x3 depthwise relu"
    label: str  # the input, e.g. "16" or "1x4x8x8"
    make_inputs: Callable[[str], list]  # device -> fresh inputs (a list of args)
    grad_inputs: tuple[int, ...]  # the inputs that require grad in the "with grad" rows
    ours: Callable  # opforge's call on those inputs
    torch_fn: Callable | None  # the torch code it replaces (None: its library is missing)
    torch_name: str
    compare: Callable | None = None  # check(ours_out, torch_out); default: torch.testing.assert_close


def _randn(*shape: int) -> Callable[[str], torch.Tensor]:
    return lambda device: torch.randn(*shape, device=device)


def tiny_boxes(device: str, n: int = 16, classes: int = 0) -> list:
    """n boxes (x1, y1, x2, y2) on a 1/16-px grid, n distinct scores, and class ids when asked.

    On the grid the IoUs are exact in float32 up to the last division, so
    opforge and torchvision keep the same boxes.
    """
    centre = torch.rand(n, 2, device=device, dtype=torch.float64) * _BOX_IMAGE
    size = torch.rand(n, 2, device=device, dtype=torch.float64) * 28.0 + 4.0
    boxes = ((torch.cat([centre - size / 2, centre + size / 2], 1) * 16).round() / 16).float()
    scores = ((torch.randperm(n, device=device) + 1) / n).float()
    return [boxes, scores] + ([torch.randint(0, classes, (n,), device=device)] if classes else [])


def _equal(ours, theirs) -> None:
    if not torch.equal(ours.cpu(), theirs.cpu()):
        raise AssertionError(f"kept indices differ: {ours.tolist()} vs {theirs.tolist()}")


def _padded_equal(ours, theirs) -> None:
    padded, count = ours
    _equal(padded[: int(count)], theirs[: padded.numel()])


def _conv_cases(opforge) -> list[OverheadCase]:
    out = []
    for kind, groups, wshape in (("dense", 1, (4, 4, 3, 3)), ("depthwise", 4, (4, 1, 3, 3))):

        def inputs(device, wshape=wshape):
            return [
                torch.randn(1, 4, 8, 8, device=device),
                torch.randn(*wshape, device=device),
                torch.randn(4, device=device),
            ]

        for act in ("relu", None):
            ours = lambda x, w, b, g=groups, a=act: opforge.conv2d_3x3(x, w, b, 1, 1, g, activation=a)  # noqa: E731
            if act == "relu":
                ref = lambda x, w, b, g=groups: torch.relu(F.conv2d(x, w, b, 1, 1, 1, g))  # noqa: E731
                ref_name = "torch.relu(F.conv2d(...))"
            else:
                ref = lambda x, w, b, g=groups: F.conv2d(x, w, b, 1, 1, 1, g)  # noqa: E731
                ref_name = "F.conv2d(...)"
            out.append(
                OverheadCase(
                    op=f"conv2d_3x3 {kind}" + (" relu" if act else ""),
                    label="1x4x8x8, k3 p1",
                    make_inputs=inputs,
                    grad_inputs=(0, 1, 2),
                    ours=ours,
                    torch_fn=ref,
                    torch_name=ref_name,
                )
            )
    return out


def _nms_cases(opforge) -> list[OverheadCase]:
    try:
        import torchvision
    except ImportError:  # torchvision is optional: the torch column stays empty
        torchvision = None
    tv_nms = torchvision and (lambda b, s: torchvision.ops.nms(b, s, 0.5))
    tv_batched = torchvision and (lambda b, s, i: torchvision.ops.batched_nms(b, s, i, 0.5))
    return [
        OverheadCase(
            op="nms",
            label="16 boxes",
            make_inputs=tiny_boxes,
            grad_inputs=(0, 1),
            ours=lambda b, s: opforge.nms(b, s, 0.5),
            torch_fn=tv_nms,
            torch_name="torchvision.ops.nms",
            compare=_equal,
        ),
        OverheadCase(
            op="batched_nms",
            label="16 boxes, 4 classes",
            make_inputs=lambda device: tiny_boxes(device, classes=4),
            grad_inputs=(0, 1),
            ours=lambda b, s, i: opforge.batched_nms(b, s, i, 0.5),
            torch_fn=tv_batched,
            torch_name="torchvision.ops.batched_nms",
            compare=_equal,
        ),
        OverheadCase(
            op="nms_padded",
            label="16 boxes, max_output 16",
            make_inputs=tiny_boxes,
            grad_inputs=(0, 1),
            ours=lambda b, s: opforge.nms_padded(b, s, 0.5, 16),
            torch_fn=tv_nms,
            torch_name="torchvision.ops.nms",
            compare=_padded_equal,
        ),
    ]


def cases() -> list[OverheadCase]:
    """Every public op of opforge, each once (the runner adds the with/without-grad variants)."""
    import opforge

    def pair(device):
        return [torch.randn(16, device=device), torch.randn(16, device=device)]

    def scores_and_mask(device):
        return [torch.randn(1, 1, 4, 4, device=device), torch.randn(1, 1, 4, 4, device=device)]

    return [
        OverheadCase(
            op="add_relu",
            label="16",
            make_inputs=pair,
            grad_inputs=(0, 1),
            ours=opforge.add_relu,
            torch_fn=lambda a, b: torch.relu(a + b),
            torch_name="torch.relu(a + b)",
        ),
        OverheadCase(
            op="add",
            label="16",
            make_inputs=pair,
            grad_inputs=(0, 1),
            ours=opforge.add,
            torch_fn=torch.add,
            torch_name="torch.add",
        ),
        OverheadCase(
            op="softmax",
            label="4x4, dim -1",
            make_inputs=lambda d: [_randn(4, 4)(d)],
            grad_inputs=(0,),
            ours=lambda x: opforge.softmax(x, -1),
            torch_fn=lambda x: torch.softmax(x, -1),
            torch_name="torch.softmax",
        ),
        OverheadCase(
            op="log_softmax",
            label="4x4, dim -1",
            make_inputs=lambda d: [_randn(4, 4)(d)],
            grad_inputs=(0,),
            ours=lambda x: opforge.log_softmax(x, -1),
            torch_fn=lambda x: torch.log_softmax(x, -1),
            torch_name="torch.log_softmax",
        ),
        OverheadCase(
            op="scaled_masked_softmax",
            label="1x1x4x4, additive mask",
            make_inputs=scores_and_mask,
            grad_inputs=(0,),
            ours=lambda x, m: opforge.scaled_masked_softmax(x, m, 0.5),
            torch_fn=lambda x, m: torch.softmax(x * 0.5 + m, -1),
            torch_name="torch.softmax(x * scale + mask, -1)",
        ),
        *_conv_cases(opforge),
        *_nms_cases(opforge),
    ]
