"""opforge.nms / batched_nms / nms_padded against torchvision.ops.

The reference is torchvision's CPU kernel (its IoU formula is the one opforge
computes). torchvision's sort is not stable, so wherever scores can tie the
reference first orders the boxes by a stable sort and hands torchvision
strictly decreasing scores: that is the documented tie rule (lower index
first) with torchvision's suppression.
"""

import math

import pytest
import torch
import torchvision
from nms_check import check, rand_boxes, rand_scores
from reference import DTYPES
from torchvision.ops.boxes import _batched_nms_vanilla

import opforge


@pytest.mark.parametrize("n", [1, 2, 7, 64, 65, 200, 1000, 3000])
@pytest.mark.parametrize("wmax", [8.0, 64.0, 400.0])
@pytest.mark.parametrize("thr", [0.0, 0.5, 0.7, 1.0])
def test_random_vs_torchvision(n, wmax, thr, device):
    boxes = rand_boxes(n, device=device, wmax=wmax)
    scores = rand_scores(n, device=device)
    out = check(boxes, scores, thr)
    # distinct scores: torchvision directly, no tie handling needed
    assert torch.equal(out.cpu(), torchvision.ops.nms(boxes.cpu(), scores.cpu(), thr))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [0, 1, 50, 777])
def test_dtypes(dtype, n, device):
    # float16/bfloat16: the result of torchvision on the same boxes in float32
    # (scores tie often in these types; ties follow the index).
    check(rand_boxes(n, dtype, device, img=200.0), rand_scores(n, dtype, device), 0.45)


@pytest.mark.parametrize("dtype", DTYPES)
def test_scores_of_another_dtype(dtype, device):
    boxes = rand_boxes(300, torch.float32, device, img=200.0)
    check(boxes, rand_scores(300, dtype, device), 0.5)


def test_empty(device):
    boxes = torch.empty(0, 4, device=device)
    scores = torch.empty(0, device=device)
    assert opforge.nms(boxes, scores, 0.5).shape == (0,)
    assert opforge.batched_nms(boxes, scores, torch.empty(0, dtype=torch.int64, device=device), 0.5).shape == (0,)
    padded, count = opforge.nms_padded(boxes, scores, 0.5, 4)
    assert padded.tolist() == [-1, -1, -1, -1] and count.item() == 0
    padded, count = opforge.nms_padded(rand_boxes(5, device=device), rand_scores(5, device=device), 0.5, 0)
    assert padded.shape == (0,) and count.item() == 0


@pytest.mark.parametrize("thr", [0.1, 0.3, 0.5, 0.7, 0.9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_just_above_and_below_threshold(thr, dtype, device):
    # Box k+1 lies inside box 0 with IoU = its width / 10 (exact in binary for
    # these widths): IoU = thr +- 2^-12 for the two halves.
    eps = 2.0**-12
    ious = []
    rows = [[0.0, 0.0, 10.0, 10.0]]
    for k in range(20):
        iou = thr + (eps if k % 2 else -eps) * (1 + k // 2)
        ious.append(iou)
        rows.append([0.0, 0.0, 10.0 * iou, 10.0])
    boxes = torch.tensor(rows, dtype=dtype, device=device)
    scores = torch.linspace(1.0, 0.5, len(rows), dtype=dtype, device=device)
    out = check(boxes, scores, thr)
    # the suppressed boxes are exactly those above the threshold (and among
    # the others, those suppressed by a kept one of them)
    assert 0 in out.tolist()
    for k, iou in enumerate(ious):
        if iou > thr:
            assert k + 1 not in out.tolist()


def test_exact_threshold_is_kept(device):
    # IoU exactly 0.5: kept (suppression needs IoU > threshold)
    boxes = torch.tensor([[0.0, 0.0, 10.0, 10.0], [0.0, 0.0, 5.0, 10.0]], device=device)
    scores = torch.tensor([0.9, 0.8], device=device)
    assert opforge.nms(boxes, scores, 0.5).tolist() == [0, 1]
    assert opforge.nms(boxes, scores, 0.4999).tolist() == [0]


def test_threshold_not_representable_in_float32(device):
    # 0.1 in float32 is above 0.1: an IoU equal to float32(0.1) exceeds the
    # exact threshold 0.1 and is suppressed, as in torchvision's CPU kernel.
    t32 = torch.tensor(0.1, dtype=torch.float32).item()
    boxes = torch.tensor([[0.0, 0.0, 1.0, 1.0], [0.0, 0.0, t32, 1.0]], device=device)
    scores = torch.tensor([0.9, 0.8], device=device)
    expected = torchvision.ops.nms(boxes.cpu(), scores.cpu(), 0.1)
    assert opforge.nms(boxes, scores, 0.1).tolist() == expected.tolist() == [0]


@pytest.mark.parametrize("levels", [1, 3, 20])
def test_tied_scores_lower_index_first(levels, device):
    n = 500
    boxes = rand_boxes(n, device=device, img=300.0)
    scores = torch.randint(0, levels, (n,)).float().to(device) / levels
    out = check(boxes, scores, 0.5)
    s = scores.cpu()[out.cpu()]
    for a, b, sa, sb in zip(out[:-1].tolist(), out[1:].tolist(), s[:-1].tolist(), s[1:].tolist()):
        assert sa > sb or (sa == sb and a < b)


def test_all_tied_identical_boxes(device):
    boxes = torch.tensor([[1.0, 2.0, 3.0, 4.0]] * 9, device=device)
    scores = torch.full((9,), 0.5, device=device)
    assert opforge.nms(boxes, scores, 0.5).tolist() == [0]
    assert opforge.nms(boxes, scores, 1.0).tolist() == list(range(9))  # IoU 1 is not > 1


def test_duplicates(device):
    base = rand_boxes(200, device=device, img=300.0)
    boxes = torch.cat([base, base, base[:50]])
    check(boxes, rand_scores(boxes.shape[0], device=device), 0.6)


@pytest.mark.parametrize("dtype,offset", [(torch.float32, 1e5), (torch.float32, 3e6), (torch.float64, 1e12)])
def test_large_coordinates(dtype, offset, device):
    boxes = (rand_boxes(500, torch.float64, img=1000.0) + offset).to(dtype).to(device)
    check(boxes, rand_scores(500, device=device), 0.5)


def test_zero_area_and_inverted_boxes(device):
    boxes = rand_boxes(300, device=device, img=200.0)
    boxes[::7, 2] = boxes[::7, 0]  # zero width
    boxes[1::7, 3] = boxes[1::7, 1]  # zero height
    boxes[2::7, 0], boxes[2::7, 2] = boxes[2::7, 2].clone(), boxes[2::7, 0].clone()  # inverted x
    boxes[3::7] = boxes[3::7].flip(1)  # fully inverted
    check(boxes, rand_scores(300, device=device), 0.3)
    check(boxes, rand_scores(300, device=device), 0.0)


def test_nan_policy(device):
    nan = float("nan")
    boxes = torch.tensor(
        [
            [0.0, 0.0, 10.0, 10.0],
            [0.0, 0.0, 10.0, 10.0],
            [nan, 0.0, 10.0, 10.0],
            [1.0, 1.0, 10.0, 10.0],
            [0.0, 0.0, 10.0, 10.0],
        ],
        device=device,
    )
    scores = torch.tensor([0.9, nan, 0.95, 0.8, 0.7], device=device)
    # NaN score sorts first and is kept (suppressing 0, 3, 4); the NaN box is
    # kept and suppresses nothing.
    out = opforge.nms(boxes, scores, 0.5)
    assert out.tolist() == [1, 2]
    assert out.tolist() == torchvision.ops.nms(boxes.cpu(), scores.cpu(), 0.5).tolist()
    # with score_threshold the NaN score is dropped
    assert opforge.nms(boxes, scores, 0.5, score_threshold=0.0).tolist() == [2, 0]
    padded, count = opforge.nms_padded(boxes, scores, 0.5, 3, score_threshold=0.0)
    assert padded.tolist() == [2, 0, -1] and count.item() == 2


@pytest.mark.parametrize("st", [None, 0.3, 0.9, 1.5])
@pytest.mark.parametrize("mo", [None, 0, 1, 17, 10_000])
def test_score_threshold_and_max_output(st, mo, device):
    boxes = rand_boxes(700, device=device, img=300.0)
    scores = rand_scores(700, device=device)
    check(boxes, scores, 0.5, score_threshold=st, max_output=mo)
    idxs = torch.randint(0, 5, (700,), device=device)
    check(boxes, scores, 0.5, idxs=idxs, score_threshold=st, max_output=mo)


@pytest.mark.parametrize("n,classes", [(1, 1), (100, 1), (500, 3), (2000, 80), (3000, 7), (6000, 2)])
@pytest.mark.parametrize("idx_dtype", [torch.int64, torch.int32])
def test_batched_vs_torchvision(n, classes, idx_dtype, device):
    boxes = rand_boxes(n, device=device, img=300.0, wmax=100.0)
    scores = rand_scores(n, device=device)
    idxs = torch.randint(0, classes, (n,), device=device) * 3 - 5  # any integers, negative too
    out = check(boxes, scores, 0.5, idxs=idxs.to(idx_dtype))
    ref = torchvision.ops.batched_nms(boxes.cpu(), scores.cpu(), idxs.cpu(), 0.5)
    assert torch.equal(out.cpu(), ref)


def test_batched_classes_never_suppress_each_other(device):
    boxes = torch.tensor([[0.0, 0.0, 1.0, 1.0]] * 6, device=device)
    scores = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], device=device)
    idxs = torch.tensor([0, 1, 2, 0, 1, 2], device=device)
    assert opforge.batched_nms(boxes, scores, idxs, 0.5).tolist() == [5, 4, 3]


def test_strided_inputs(device):
    wide = rand_boxes(1200, device=device, img=300.0).repeat(1, 2)[::2, 2:6]  # non-contiguous rows
    scores = rand_scores(1800, device=device)[::3]
    assert not wide.is_contiguous() and not scores.is_contiguous()
    check(wide, scores, 0.5)
    check(wide.t().contiguous().t(), scores, 0.5)  # column-major
    check(wide, scores, 0.5, idxs=torch.randint(0, 4, (1200,), device=device)[::2].repeat(2)[:600])


def test_not_differentiable(device):
    boxes = rand_boxes(50, device=device).requires_grad_()
    scores = rand_scores(50, device=device).requires_grad_()
    out = opforge.nms(boxes, scores, 0.5)
    assert not out.requires_grad and out.dtype == torch.int64
    with pytest.raises(RuntimeError):
        out.sum().backward()
    padded, count = opforge.nms_padded(boxes, scores, 0.5, 8)
    assert not padded.requires_grad and not count.requires_grad
    # gradients flow through the usual gather instead
    boxes[out].sum().backward()
    assert boxes.grad is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_autocast(dtype, device):
    boxes = rand_boxes(300, dtype, device, img=200.0)
    scores = rand_scores(300, dtype, device)
    expected = opforge.nms(boxes, scores, 0.5)
    for amp in (torch.float16, torch.bfloat16):
        with torch.autocast(device_type=device, dtype=amp):
            assert torch.equal(opforge.nms(boxes, scores, 0.5), expected)


def _odd_boxes(n, device):
    """Ordinary boxes mixed with zero-area and inverted ones (negative areas)."""
    boxes = rand_boxes(n, device=device, img=200.0)
    boxes[::7, 2] = boxes[::7, 0]  # zero width
    boxes[1::7, 3] = boxes[1::7, 1]  # zero height
    boxes[2::7, 0], boxes[2::7, 2] = boxes[2::7, 2].clone(), boxes[2::7, 0].clone()  # inverted x
    boxes[3::7] = boxes[3::7].flip(1)  # fully inverted
    return boxes


@pytest.mark.parametrize(
    "thr", [-math.inf, -1e300, -1.0, -0.1, -0.0, 1.0 + 2.0**-20, 1.5, 1e39, 1e300, math.inf, math.nan]
)
def test_any_iou_threshold_as_torchvision(thr, device):
    # torchvision takes any float: above 1 (or NaN) nothing is suppressed,
    # below 0 even boxes that do not overlap (IoU 0) are. Inverted boxes have
    # negative areas, so their IoUs can be negative or above 1.
    boxes = _odd_boxes(300, device)
    scores = rand_scores(300, device=device)
    out = check(boxes, scores, thr)
    assert torch.equal(out.cpu(), torchvision.ops.nms(boxes.cpu(), scores.cpu(), thr))
    check(boxes, scores, thr, idxs=torch.randint(0, 4, (300,), device=device))
    check(boxes.double(), scores, thr)


def test_negative_iou_threshold_keeps_the_top_box_of_each_class(device):
    boxes = rand_boxes(50, device=device)
    scores = rand_scores(50, device=device)
    top = int(scores.argmax())
    assert opforge.nms(boxes, scores, -0.5).tolist() == [top]
    idxs = torch.arange(50, device=device) % 3
    expected = sorted(
        (int(torch.nonzero(idxs == c)[scores[idxs == c].argmax()]) for c in range(3)), key=lambda i: -float(scores[i])
    )
    assert opforge.batched_nms(boxes, scores, idxs, -0.5).tolist() == expected


def test_nan_iou_threshold_keeps_every_box(device):
    boxes = torch.tensor([[0.0, 0.0, 1.0, 1.0]] * 4, device=device)
    scores = torch.tensor([0.4, 0.3, 0.2, 0.1], device=device)
    assert opforge.nms(boxes, scores, math.nan).tolist() == [0, 1, 2, 3]
    assert torchvision.ops.nms(boxes.cpu(), scores.cpu(), math.nan).tolist() == [0, 1, 2, 3]


def test_opcheck(device):
    b = rand_boxes(40, device=device, img=100.0)
    s = rand_scores(40, device=device)
    idxs = torch.randint(0, 3, (40,), device=device)
    torch.library.opcheck(torch.ops.opforge.nms.default, (b, s, 0.5), {"max_output": 30})
    torch.library.opcheck(torch.ops.opforge.batched_nms.default, (b, s, idxs, 0.5), {"score_threshold": 0.1})
    torch.library.opcheck(torch.ops.opforge.nms_padded.default, (b, s, 0.5, 16), {"idxs": idxs})
    torch.library.opcheck(torch.ops.opforge.nms_padded.default, (b.half(), s, 0.3, 50), {})
    torch.library.opcheck(torch.ops.opforge.nms.default, (b, s, -0.5), {})  # any float threshold
    torch.library.opcheck(torch.ops.opforge._nms_check.default, (b, s, None, None, 30), {})
    torch.library.opcheck(torch.ops.opforge._nms_check.default, (b, s, idxs, 0.1, None), {})
    # inputs that require grad: test_autograd_registration runs (the outputs
    # are indices, so none of them may require grad)
    bg, sg = b.clone().requires_grad_(), s.clone().requires_grad_()
    torch.library.opcheck(torch.ops.opforge.nms.default, (bg, sg, 0.5), {})
    torch.library.opcheck(torch.ops.opforge.batched_nms.default, (bg, sg, idxs, 0.5), {"max_output": 5})
    torch.library.opcheck(torch.ops.opforge.nms_padded.default, (bg, sg, 0.5, 16), {"score_threshold": 0.2})
    torch.library.opcheck(torch.ops.opforge._nms_check.default, (bg, sg, idxs, None, None), {})


def test_compile(device):
    torch._dynamo.reset()
    counts = {"n": 0}

    def backend(gm, example_inputs):
        counts["n"] += 1
        return gm

    @torch.compile(fullgraph=True, dynamic=True, backend=backend)
    def detect(boxes, scores, idxs):
        keep = opforge.nms(boxes, scores, 0.5)
        bkeep = opforge.batched_nms(boxes, scores, idxs, 0.5, max_output=100)
        padded, count = opforge.nms_padded(boxes, scores, 0.5, 64, idxs=idxs)
        return boxes[keep] * 2, bkeep, padded, count

    for n in (50, 80, 120):
        b = rand_boxes(n, device=device, img=100.0)
        s = rand_scores(n, device=device)
        idxs = torch.randint(0, 3, (n,), device=device)
        kept_boxes, bkeep, padded, count = detect(b, s, idxs)
        assert torch.equal(kept_boxes, b[opforge.nms(b, s, 0.5)] * 2)
        assert torch.equal(bkeep, opforge.batched_nms(b, s, idxs, 0.5, max_output=100))
        ep, ec = opforge.nms_padded(b, s, 0.5, 64, idxs=idxs)
        assert torch.equal(padded, ep) and torch.equal(count, ec)
    assert counts["n"] == 1

    compiled = torch.compile(lambda b, s: opforge.nms(b, s, 0.5), fullgraph=True)  # inductor
    b = rand_boxes(100, device=device, img=100.0)
    s = rand_scores(100, device=device)
    assert torch.equal(compiled(b, s), opforge.nms(b, s, 0.5))


def test_export_padded(device):
    class Detect(torch.nn.Module):
        def forward(self, boxes, scores, idxs):
            return opforge.nms_padded(boxes, scores, 0.5, 32, idxs=idxs, score_threshold=0.1)

    b = rand_boxes(60, device=device, img=100.0)
    s = rand_scores(60, device=device)
    idxs = torch.randint(0, 3, (60,), device=device)
    n = torch.export.Dim("n", min=2)
    ep = torch.export.export(Detect(), (b, s, idxs), dynamic_shapes=({0: n}, {0: n}, {0: n}))
    b2 = rand_boxes(90, device=device, img=100.0)
    s2 = rand_scores(90, device=device)
    i2 = torch.randint(0, 3, (90,), device=device)
    out = ep.module()(b2, s2, i2)
    ref = opforge.nms_padded(b2, s2, 0.5, 32, idxs=i2, score_threshold=0.1)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])


def _grid_pairs(cells, device, dtype=torch.float32):
    """`cells` far-apart squares, each with a shifted twin (IoU ~0.82): NMS at
    0.5 keeps exactly the higher-scoring box of each pair."""
    side = int(math.ceil(math.sqrt(cells)))
    k = torch.arange(cells, dtype=torch.float64)
    x = (k % side) * 20.0
    y = torch.div(k, side, rounding_mode="floor") * 20.0
    a = torch.stack([x, y, x + 10, y + 10], 1)
    b = a + torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    boxes = torch.stack([a, b], 1).reshape(-1, 4)
    scores = torch.randperm(2 * cells, dtype=torch.float64) / (2 * cells)
    pair = scores.view(-1, 2)
    winner = torch.arange(cells) * 2 + (pair[:, 1] > pair[:, 0]).long()
    expected = winner[torch.sort(scores[winner], descending=True)[1]]
    return boxes.to(dtype).to(device), scores.float().to(device), expected


@pytest.mark.cuda
@pytest.mark.parametrize("cells", [100_000, 500_000])
def test_cuda_large_chunked(cells):
    # 1M boxes need the chunked mask (the whole one would be 125 GB).
    boxes, scores, expected = _grid_pairs(cells, "cuda")
    out = opforge.nms(boxes, scores, 0.5)
    assert torch.equal(out.cpu(), expected)
    padded, count = opforge.nms_padded(boxes, scores, 0.5, 1000)
    assert count.item() == 1000 and torch.equal(padded.cpu(), expected[:1000])
    idxs = torch.randint(0, 80, (2 * cells,), device="cuda")
    idxs = idxs.view(-1, 2)[:, :1].expand(-1, 2).reshape(-1).contiguous()  # twins share a class
    assert torch.equal(opforge.batched_nms(boxes, scores, idxs, 0.5).cpu(), expected)


@pytest.mark.cuda
@pytest.mark.parametrize("n", [10_000, 200_000])
def test_cuda_vs_torchvision_cuda_integer_boxes(n):
    # Integer coordinates make every IoU step exact, so torchvision's CUDA
    # kernel (float threshold, fused multiply-adds) must agree bit for bit.
    xy = torch.randint(0, 3000, (n, 2), device="cuda").float()
    wh = torch.randint(1, 64, (n, 2), device="cuda").float()
    boxes = torch.cat([xy, xy + wh], 1)
    scores = rand_scores(n, device="cuda")  # distinct: torchvision's sort is not stable
    assert torch.equal(opforge.nms(boxes, scores, 0.5), torchvision.ops.nms(boxes, scores, 0.5))
    idxs = torch.randint(0, 80, (n,), device="cuda")
    assert torch.equal(opforge.batched_nms(boxes, scores, idxs, 0.5), _batched_nms_vanilla(boxes, scores, idxs, 0.5))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_matches_cpu(dtype):
    boxes = rand_boxes(5000, dtype, img=500.0)
    scores = rand_scores(5000, dtype)
    idxs = torch.randint(0, 10, (5000,))
    for thr in (0.3, 0.5, 0.7):
        assert torch.equal(opforge.nms(boxes.cuda(), scores.cuda(), thr).cpu(), opforge.nms(boxes, scores, thr))
        assert torch.equal(
            opforge.batched_nms(boxes.cuda(), scores.cuda(), idxs.cuda(), thr).cpu(),
            opforge.batched_nms(boxes, scores, idxs, thr),
        )


@pytest.mark.cuda
def test_cuda_padded_graph_capture_and_no_sync():
    boxes = rand_boxes(3000, device="cuda", img=500.0)
    scores = rand_scores(3000, device="cuda")
    idxs = torch.randint(0, 5, (3000,), device="cuda")
    expected = opforge.nms_padded(boxes, scores, 0.5, 500, idxs=idxs, score_threshold=0.2)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        opforge.nms_padded(boxes, scores, 0.5, 500, idxs=idxs, score_threshold=0.2)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        opforge.nms_padded(boxes, scores, 0.5, 500, idxs=idxs, score_threshold=0.2)  # warm up
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        padded, count = opforge.nms_padded(boxes, scores, 0.5, 500, idxs=idxs, score_threshold=0.2)
    new_boxes = rand_boxes(3000, device="cuda", img=500.0)
    boxes.copy_(new_boxes)
    graph.replay()
    ref_padded, ref_count = opforge.nms_padded(new_boxes, scores, 0.5, 500, idxs=idxs, score_threshold=0.2)
    assert torch.equal(padded, ref_padded) and torch.equal(count, ref_count)
    assert not torch.equal(padded, expected[0])  # the replay saw the new boxes


@pytest.mark.cuda
def test_cuda_other_stream_and_device_guard():
    boxes = rand_boxes(2000, device="cuda", img=500.0)
    scores = rand_scores(2000, device="cuda")
    expected = opforge.nms(boxes, scores, 0.5)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out = opforge.nms(boxes, scores, 0.5)
    torch.cuda.current_stream().wait_stream(stream)
    assert torch.equal(out, expected)
