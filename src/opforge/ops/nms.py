"""Non-maximum suppression: ``nms``, ``batched_nms`` and ``nms_padded``.

Semantics are torchvision's (``torchvision.ops.nms`` / ``batched_nms``):
boxes are ``(x1, y1, x2, y2)``; a box is dropped when its IoU with a kept box
of higher score is strictly greater than ``iou_threshold``; the result holds
the indices (int64) of the kept boxes in decreasing score order. IoU is
torchvision's formula, computed in float32 (float64 for float64 boxes), so
float16/bfloat16 boxes give exactly what torchvision gives on the same boxes
converted to float32. ``iou_threshold`` is compared exactly (as a float64)
and may be any float, as in torchvision: above 1, or NaN, nothing is
suppressed (no IoU of ordinary boxes exceeds it); below 0 even boxes that do
not overlap (IoU 0) are, so only the top-scoring one is kept.

Choices where torchvision leaves the result open or has none:

* Tied scores: the lower index comes first (a stable sort), on CPU and CUDA.
* NaN scores sort first, as ``torch.sort`` puts them (torchvision does the
  same); with ``score_threshold`` they are dropped (``NaN > t`` is false).
* A box with a NaN coordinate has IoU NaN with every box, so it neither
  suppresses nor is suppressed: it is kept (as in torchvision).
* Zero-area and inverted boxes (x2 < x1) use the formula as is, exactly as
  torchvision does: their intersection with anything is 0, so for any
  ``iou_threshold >= 0`` they are kept and suppress nothing.
* ``score_threshold``: only boxes with ``score > score_threshold`` take part.
* ``max_output``: at most this many indices (the highest-scoring kept ones).
* ``batched_nms`` equals torchvision's per-class (exact) algorithm; its
  coordinate-offset variant can differ by rounding for large offsets.

The outputs are indices: nothing is differentiable, the result never
requires grad, and ``backward`` through it raises.

Checks and nms_padded's shape function are C++ (csrc/nms.h, csrc/nms.cpp);
the wrappers only name the arguments, so a call costs what
``torch.ops.opforge.nms`` costs. Shapes and devices that do not fit raise
RuntimeError (as torchvision does), wrong dtypes TypeError, unsupported
``score_threshold`` / ``max_output`` values ValueError.
"""

from __future__ import annotations

import torch

_nms = torch.ops.opforge.nms.default
_batched_nms = torch.ops.opforge.batched_nms.default
_nms_padded = torch.ops.opforge.nms_padded.default
_nms_check = torch.ops.opforge._nms_check.default


def nms(
    boxes: torch.Tensor,
    scores: torch.Tensor,
    iou_threshold: float,
    *,
    score_threshold: float | None = None,
    max_output: int | None = None,
) -> torch.Tensor:
    """Indices (int64) of the boxes kept by non-maximum suppression, in decreasing score order.

    Equal to ``torchvision.ops.nms(boxes, scores, iou_threshold)``; tied
    scores keep the lower index first. ``score_threshold`` drops boxes with
    ``score <= score_threshold`` first; ``max_output`` keeps at most that many.

    >>> import torch, opforge
    >>> boxes = torch.tensor([[0.0, 0.0, 10.0, 10.0], [1.0, 1.0, 11.0, 11.0], [20.0, 20.0, 30.0, 30.0]])
    >>> opforge.nms(boxes, torch.tensor([0.9, 0.8, 0.7]), 0.5)
    tensor([0, 2])
    """
    return _nms(boxes, scores, iou_threshold, score_threshold=score_threshold, max_output=max_output)


def batched_nms(
    boxes: torch.Tensor,
    scores: torch.Tensor,
    idxs: torch.Tensor,
    iou_threshold: float,
    *,
    score_threshold: float | None = None,
    max_output: int | None = None,
) -> torch.Tensor:
    """Per-category NMS: boxes with different ``idxs`` never suppress each other.

    Equal to ``torchvision.ops.batched_nms``; the result is in decreasing
    score order over all categories (ties: lower index first).

    >>> import torch, opforge
    >>> boxes = torch.tensor([[0.0, 0.0, 10.0, 10.0], [1.0, 1.0, 11.0, 11.0], [1.0, 1.0, 11.0, 11.0]])
    >>> opforge.batched_nms(boxes, torch.tensor([0.9, 0.8, 0.7]), torch.tensor([0, 0, 1]), 0.5)
    tensor([0, 2])
    """
    return _batched_nms(boxes, scores, idxs, iou_threshold, score_threshold=score_threshold, max_output=max_output)


def nms_padded(
    boxes: torch.Tensor,
    scores: torch.Tensor,
    iou_threshold: float,
    max_output: int,
    *,
    idxs: torch.Tensor | None = None,
    score_threshold: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """NMS with an output shape that does not depend on the data.

    Returns ``(indices, count)``: ``indices`` has shape ``(max_output,)``, its
    first ``count`` entries are ``nms(...)[:max_output]`` and the rest are -1;
    ``count`` is a 0-d int64 tensor on the boxes' device. On CUDA nothing is
    copied to the host, so it can be captured in a CUDA graph and exported.
    With ``idxs`` it is per category, as ``batched_nms``.

    >>> import torch, opforge
    >>> boxes = torch.tensor([[0.0, 0.0, 10.0, 10.0], [1.0, 1.0, 11.0, 11.0], [20.0, 20.0, 30.0, 30.0]])
    >>> opforge.nms_padded(boxes, torch.tensor([0.9, 0.8, 0.7]), 0.5, max_output=4)
    (tensor([ 0,  2, -1, -1]), tensor(2))
    """
    return _nms_padded(boxes, scores, iou_threshold, max_output, idxs=idxs, score_threshold=score_threshold)


# --------------------------------------------------------------------------- fake kernels
# The output's length depends on the data: a new symbolic size. The argument
# checks are the kernels' own, in C++ (_nms_check). nms_padded's shape
# function is C++ (csrc/nms.cpp).


@torch.library.register_fake("opforge::nms")
def _nms_fake(boxes, scores, iou_threshold, *, score_threshold=None, max_output=None):
    _nms_check(boxes, scores, None, score_threshold, max_output)
    n = torch.library.get_ctx().new_dynamic_size()
    return boxes.new_empty((n,), dtype=torch.int64)


@torch.library.register_fake("opforge::batched_nms")
def _batched_nms_fake(boxes, scores, idxs, iou_threshold, *, score_threshold=None, max_output=None):
    _nms_check(boxes, scores, idxs, score_threshold, max_output)
    n = torch.library.get_ctx().new_dynamic_size()
    return boxes.new_empty((n,), dtype=torch.int64)
