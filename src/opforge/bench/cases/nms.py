"""Bench cases of the nms family, against torchvision.ops.nms / batched_nms.

Boxes: centres uniform in a 1000 x 1000 image, widths and heights uniform in
[4, 64] px, every coordinate on a 1/16-px grid. On that grid every step of
the IoU is exact in float32 except the final division (correctly rounded
everywhere), so torchvision's kernels and opforge's agree bit for bit and the
cases compare results exactly. With this density most boxes survive (at 20k
boxes about 70% at IoU 0.5), which is what makes torchvision's CPU kernel
quadratic; its timings on these boxes match the baselines in ENGINEERING.md.
Scores are a random permutation of n distinct values (no ties, so
torchvision's order is defined). IoU threshold 0.5. No composition to
compile (compile=False); the peer is torchvision.
"""

from __future__ import annotations

import torch

import opforge

try:  # the peer; without it there is nothing to compare against
    import torchvision
except ImportError:  # pragma: no cover
    torchvision = None

from ..case import BenchCase, register


def make_boxes(n: int, device: str, dtype=torch.float32, classes: int = 0) -> list:
    centre = torch.rand(n, 2, device=device, dtype=torch.float64) * 1000.0
    size = torch.rand(n, 2, device=device, dtype=torch.float64) * 60.0 + 4.0
    boxes = torch.cat([centre - size / 2, centre + size / 2], 1)
    boxes = (boxes * 16).round() / 16
    scores = (torch.randperm(n, device=device, dtype=torch.float64) + 1) / n
    out = [boxes.to(dtype), scores.to(dtype)]
    if classes:
        out.append(torch.randint(0, classes, (n,), device=device))
    return out


def _equal(ours, theirs) -> None:
    if not torch.equal(ours.cpu(), theirs.cpu()):
        raise AssertionError(f"kept indices differ: {ours.numel()} vs {theirs.numel()} kept")


def _padded_equal(ours, theirs) -> None:
    if isinstance(ours, torch.Tensor):  # the harness also checks eager against itself
        _equal(ours, theirs)
        return
    padded, count = ours
    k = int(count)
    _equal(padded[:k], theirs[: padded.numel()])


@register("nms")
def cases(device: str) -> list[BenchCase]:
    if torchvision is None:
        return []
    out = []
    sizes = (1_000, 10_000, 50_000, 200_000) if device == "cuda" else (5_000, 20_000)
    tv_nms = lambda b, s: torchvision.ops.nms(b, s, 0.5)  # noqa: E731
    for n in sizes:
        out.append(
            BenchCase(
                op="nms",
                label=f"N={n // 1000}k",
                dtype=torch.float32,
                make_inputs=lambda n=n: make_boxes(n, device),
                ours=lambda b, s: opforge.nms(b, s, 0.5),
                eager=tv_nms,
                eager_name="torchvision.ops.nms",
                peer=tv_nms,
                peer_name="torchvision.ops.nms",
                compile=False,
                compare=_equal,
                quick=n in (1_000, 10_000, 5_000),
            )
        )
    n = 50_000 if device == "cuda" else 20_000
    tv_batched = lambda b, s, i: torchvision.ops.batched_nms(b, s, i, 0.5)  # noqa: E731
    out.append(
        BenchCase(
            op="batched_nms",
            label=f"N={n // 1000}k, 80 classes",
            dtype=torch.float32,
            make_inputs=lambda: make_boxes(n, device, classes=80),
            ours=lambda b, s, i: opforge.batched_nms(b, s, i, 0.5),
            eager=tv_batched,
            eager_name="torchvision.ops.batched_nms",
            peer=tv_batched,
            peer_name="torchvision.ops.batched_nms",
            compile=False,
            compare=_equal,
            quick=True,
        )
    )
    if device == "cuda":
        # The graph-capturable form (no host sync), kept at most 1000 boxes.
        out.append(
            BenchCase(
                op="nms_padded",
                label="N=10k, max_output=1000",
                dtype=torch.float32,
                make_inputs=lambda: make_boxes(10_000, device),
                ours=lambda b, s: opforge.nms_padded(b, s, 0.5, 1000),
                eager=tv_nms,
                eager_name="torchvision.ops.nms",
                peer=tv_nms,
                peer_name="torchvision.ops.nms",
                compile=False,
                compare=_padded_equal,
            )
        )
    return out
