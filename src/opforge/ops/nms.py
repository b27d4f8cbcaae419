"""Non-maximum suppression: ``nms``, ``batched_nms`` and ``nms_padded``.

Semantics are torchvision's (``torchvision.ops.nms`` / ``batched_nms``):
boxes are ``(x1, y1, x2, y2)``; a box is dropped when its IoU with a kept box
of higher score is strictly greater than ``iou_threshold``; the result holds
the indices (int64) of the kept boxes in decreasing score order. IoU is
torchvision's formula, computed in float32 (float64 for float64 boxes), so
float16/bfloat16 boxes give exactly what torchvision gives on the same boxes
converted to float32. ``iou_threshold`` is compared exactly (as a float64).

Choices where torchvision leaves the result open or has none:

* Tied scores: the lower index comes first (a stable sort), on CPU and CUDA.
* NaN scores sort first, as ``torch.sort`` puts them (torchvision does the
  same); with ``score_threshold`` they are dropped (``NaN > t`` is false).
* A box with a NaN coordinate has IoU NaN with every box, so it neither
  suppresses nor is suppressed: it is kept (as in torchvision).
* Zero-area and inverted boxes (x2 < x1) use the formula as is, exactly as
  torchvision does: their intersection with anything is 0, so they are kept
  and suppress nothing.
* ``score_threshold``: only boxes with ``score > score_threshold`` take part.
* ``max_output``: at most this many indices (the highest-scoring kept ones).
* ``batched_nms`` equals torchvision's per-class (exact) algorithm; its
  coordinate-offset variant can differ by rounding for large offsets.

The outputs are indices: nothing is differentiable, the result never
requires grad, and ``backward`` through it raises.
"""

from __future__ import annotations

import math
import numbers

import torch

from . import _checks

_ns = torch.ops.opforge


def _number(op: str, name: str, value, *, optional: bool = False):
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{op}: {name} must be a number, got {type(value).__name__}")
    return float(value)


def _integer(op: str, name: str, value, *, optional: bool = False):
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, torch.SymInt)):
        raise TypeError(f"{op}: {name} must be an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{op}: {name} must be >= 0, got {value}")
    return value


def _same_length(op: str, boxes, name: str, t) -> None:
    def msg():
        return (
            f"{op}: boxes and {name} must have the same length, got boxes with {boxes.shape[0]} "
            f"and {name} with {t.shape[0]}"
        )

    if isinstance(boxes.shape[0], torch.SymInt) or isinstance(t.shape[0], torch.SymInt):
        torch._check(t.shape[0] == boxes.shape[0], msg)
    elif t.shape[0] != boxes.shape[0]:
        raise ValueError(msg())


_MAX_PADDED = 2**31 - 1


def _check(op, boxes, scores, idxs, iou_threshold, score_threshold, max_output, *, max_optional=True):
    _checks.float_tensor(op, "boxes", boxes)
    _checks.float_tensor(op, "scores", scores)
    if boxes.dim() != 2 or boxes.shape[1] != 4:
        raise ValueError(f"{op}: boxes must have shape (N, 4), got {tuple(boxes.shape)}")
    if scores.dim() != 1:
        raise ValueError(f"{op}: scores must have shape (N,), got {tuple(scores.shape)}")
    _same_length(op, boxes, "scores", scores)
    _checks.same_device(op, "boxes", boxes, "scores", scores)
    if idxs is not None:
        _checks.tensor_arg(op, "idxs", idxs)
        if idxs.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{op}: idxs must be an int64 or int32 tensor, got {idxs.dtype}")
        if idxs.dim() != 1:
            raise ValueError(f"{op}: idxs must have shape (N,), got {tuple(idxs.shape)}")
        _same_length(op, boxes, "idxs", idxs)
        _checks.same_device(op, "boxes", boxes, "idxs", idxs)
    iou = _number(op, "iou_threshold", iou_threshold)
    if not (0.0 <= iou <= 1.0):
        raise ValueError(f"{op}: iou_threshold must be in [0, 1], got {iou}")
    st = _number(op, "score_threshold", score_threshold, optional=True)
    if st is not None and math.isnan(st):
        raise ValueError(f"{op}: score_threshold must not be NaN")
    mo = _integer(op, "max_output", max_output, optional=max_optional)
    if not max_optional:  # nms_padded: its output has max_output entries (csrc/nms.h kMaxPaddedOutput)

        def too_long():
            return f"{op}: max_output must be at most {_MAX_PADDED} (the length of the padded output), got {mo}"

        if isinstance(mo, torch.SymInt):
            torch._check(mo <= _MAX_PADDED, too_long)
        elif mo > _MAX_PADDED:
            raise ValueError(too_long())
    return iou, st, mo


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
    iou, st, mo = _check("opforge.nms", boxes, scores, None, iou_threshold, score_threshold, max_output)
    return _ns.nms.default(boxes, scores, iou, score_threshold=st, max_output=mo)


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
    iou, st, mo = _check("opforge.batched_nms", boxes, scores, idxs, iou_threshold, score_threshold, max_output)
    return _ns.batched_nms.default(boxes, scores, idxs, iou, score_threshold=st, max_output=mo)


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
    iou, st, mo = _check(
        "opforge.nms_padded", boxes, scores, idxs, iou_threshold, score_threshold, max_output, max_optional=False
    )
    return _ns.nms_padded.default(boxes, scores, iou, mo, idxs=idxs, score_threshold=st)


# --------------------------------------------------------------------------- fake kernels


@torch.library.register_fake("opforge::nms")
def _nms_fake(boxes, scores, iou_threshold, *, score_threshold=None, max_output=None):
    _check("opforge.nms", boxes, scores, None, iou_threshold, score_threshold, max_output)
    n = torch.library.get_ctx().new_dynamic_size()
    return boxes.new_empty((n,), dtype=torch.int64)


@torch.library.register_fake("opforge::batched_nms")
def _batched_nms_fake(boxes, scores, idxs, iou_threshold, *, score_threshold=None, max_output=None):
    _check("opforge.batched_nms", boxes, scores, idxs, iou_threshold, score_threshold, max_output)
    n = torch.library.get_ctx().new_dynamic_size()
    return boxes.new_empty((n,), dtype=torch.int64)


@torch.library.register_fake("opforge::nms_padded")
def _nms_padded_fake(boxes, scores, iou_threshold, max_output, *, idxs=None, score_threshold=None):
    _check("opforge.nms_padded", boxes, scores, idxs, iou_threshold, score_threshold, max_output, max_optional=False)
    return boxes.new_empty((max_output,), dtype=torch.int64), boxes.new_empty((), dtype=torch.int64)
