"""The NMS tests' inputs and their reference (torchvision's NMS as the spec), shared by the NMS tests."""

import torch
import torchvision
from reference import poisoned
from torchvision.ops.boxes import _batched_nms_vanilla

import opforge

HALF = (torch.float16, torch.bfloat16)


def rand_boxes(n, dtype=torch.float32, device="cpu", img=1000.0, wmin=4.0, wmax=64.0):
    """Centres uniform in an img x img image, widths and heights uniform in [wmin, wmax]."""
    c = torch.rand(n, 2, dtype=torch.float64) * img
    wh = torch.rand(n, 2, dtype=torch.float64) * (wmax - wmin) + wmin
    return torch.cat([c - wh / 2, c + wh / 2], 1).to(dtype).to(device)


def rand_scores(n, dtype=torch.float32, device="cpu"):
    """Distinct in float32/float64 (a permutation), so torchvision's order is defined."""
    return (
        ((torch.randperm(n, dtype=torch.float64) + torch.rand(1, dtype=torch.float64)) / max(n, 1)).to(dtype).to(device)
    )


def ref_nms(boxes, scores, thr, idxs=None, score_threshold=None, max_output=None):
    """torchvision on the CPU (boxes in float32, or float64), stable tie order."""
    boxes = boxes.cpu()
    scores = scores.cpu()
    boxes = boxes.double() if boxes.dtype == torch.float64 else boxes.float()
    cand = torch.arange(boxes.shape[0])
    if score_threshold is not None:
        cand = torch.nonzero(scores.double() > score_threshold).view(-1)
    order = cand[torch.sort(scores[cand], stable=True, descending=True)[1]]
    distinct = torch.linspace(1.0, 0.0, order.numel() + 2, dtype=torch.float64)[1:-1].to(boxes.dtype)
    if idxs is None:
        keep = torchvision.ops.nms(boxes[order], distinct, thr)
    else:
        keep = _batched_nms_vanilla(boxes[order], distinct, idxs.cpu()[order], thr)
    kept = order[keep]
    if max_output is not None:
        kept = kept[:max_output]
    return kept


def check(boxes, scores, thr, idxs=None, **kw):
    with poisoned(boxes.device):
        if idxs is None:
            out = opforge.nms(boxes, scores, thr, **kw)
        else:
            out = opforge.batched_nms(boxes, scores, idxs, thr, **kw)
    expected = ref_nms(boxes, scores, thr, idxs, **kw)
    assert out.dtype == torch.int64 and out.device == boxes.device and out.dim() == 1
    assert torch.equal(out.cpu(), expected), (out, expected)
    # padded form: same indices, then -1
    k = kw.get("max_output")
    k = expected.numel() + 3 if k is None else k
    with poisoned(boxes.device):
        padded, count = opforge.nms_padded(boxes, scores, thr, k, idxs=idxs, score_threshold=kw.get("score_threshold"))
    assert padded.shape == (k,) and count.shape == () and count.dtype == torch.int64
    assert count.item() == expected.numel()
    assert torch.equal(padded[: expected.numel()].cpu(), expected)
    assert bool((padded[expected.numel() :] == -1).all())
    return out
