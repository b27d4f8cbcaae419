"""The softmax family as torch ops (opcheck, torch.compile, nn modules) and its CUDA plans."""

import pytest
import torch
from reference import poisoned, rand
from softmax_check import INF, OPS, check, check_bwd, check_fwd, check_smsm, ref_smsm

import opforge


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(dtype, device):
    x = rand((4, 6, 9), dtype, device).requires_grad_()
    for dim in (-1, 1):
        torch.library.opcheck(torch.ops.opforge.softmax.default, (x, dim, None))
        torch.library.opcheck(torch.ops.opforge.log_softmax.default, (x, dim, None))
    torch.library.opcheck(torch.ops.opforge.softmax.default, (x, 0, torch.float64))
    mask = torch.rand((6, 9), device=device) < 0.3
    torch.library.opcheck(torch.ops.opforge.scaled_masked_softmax.default, (x, mask, 0.5, True))
    torch.library.opcheck(torch.ops.opforge.scaled_masked_softmax.default, (x, None, 2.0, False))
    fmask = rand((4, 1, 9), dtype, device).requires_grad_()
    torch.library.opcheck(torch.ops.opforge.scaled_masked_softmax.default, (x, fmask, 0.5, False))
    g = rand((4, 6, 9), dtype, device)
    y = torch.softmax(rand((4, 6, 9), dtype, device), 1).requires_grad_()
    torch.library.opcheck(torch.ops.opforge._softmax_backward.default, (g, y, 1))
    torch.library.opcheck(torch.ops.opforge._log_softmax_backward.default, (g, y.log().detach(), -1))
    torch.library.opcheck(torch.ops.opforge._scaled_masked_softmax_backward.default, (g, y, 0.25))


class TinyAttention(torch.nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.attn = opforge.nn.ScaledMaskedSoftmax(scale=width**-0.5, causal=True)
        self.norm = opforge.nn.Softmax(-1)
        self.logp = opforge.nn.LogSoftmax(dim=1)

    def forward(self, x, pad):
        q, k, v = self.qkv(x).chunk(3, -1)
        p = self.attn(q @ k.transpose(-2, -1), pad[:, None, :])
        return self.logp(self.norm(p @ v))


def eager_tiny(model, x, pad):
    q, k, v = model.qkv(x).chunk(3, -1)
    s = q @ k.transpose(-2, -1) * model.attn.scale
    lq = s.shape[-1]
    above = torch.ones(lq, lq, dtype=torch.bool, device=s.device).triu(1)
    p = torch.softmax(s.masked_fill(above | pad[:, None, :], -INF), -1)
    return torch.log_softmax(torch.softmax(p @ v, -1), 1)


def test_compile_fullgraph_dynamic_no_recompiles(device):
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    model = TinyAttention().to(device)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=True)
    frames = []
    for seq in (5, 9, 17, 40):
        x = rand((2, seq, 16), device=device)
        pad = torch.zeros((2, seq), dtype=torch.bool, device=device)
        pad[1, -2:] = True  # key padding
        torch.testing.assert_close(compiled(x, pad), model(x, pad))
        torch.testing.assert_close(model(x, pad), eager_tiny(model, x, pad), atol=1e-5, rtol=1e-5)
        frames.append(counter.frame_count)
    # No recompile across sequence lengths. (dynamic=True first traces the
    # float `scale` attribute as a symbolic float; the op takes a plain
    # float, so the first compile restarts once with it specialised: at most
    # two graphs, both from the first call.)
    assert frames[0] <= 2 and frames == [frames[0]] * len(frames), f"recompiled: {frames}"


def test_compile_no_restart_with_constant_scale(device):
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")

    @torch.compile(backend=counter, fullgraph=True, dynamic=True)
    def f(x, mask):
        return opforge.scaled_masked_softmax(x, mask, 0.125, True) + opforge.softmax(x, 1)

    for seq in (6, 11, 30):
        x = rand((2, 3, seq, seq), device=device)
        mask = torch.rand((seq, seq), device=device) < 0.2
        torch.testing.assert_close(
            f(x, mask), ref_smsm(x, mask, 0.125, True).to(device) + torch.softmax(x, 1), atol=1e-5, rtol=1e-5
        )
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} frames"


def test_compile_backward(device):
    torch._dynamo.reset()
    model = TinyAttention().to(device)
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    x = rand((2, 7, 16), device=device).requires_grad_()
    pad = torch.zeros((2, 7), dtype=torch.bool, device=device)
    compiled(x, pad).sum().backward()
    gx = x.grad.clone()
    x.grad = None
    model(x, pad).sum().backward()
    torch.testing.assert_close(gx, x.grad)


def test_nn_modules(device):
    x = rand((3, 4, 5), device=device)
    assert repr(opforge.nn.Softmax(1)) == "Softmax(dim=1)"
    assert repr(opforge.nn.ScaledMaskedSoftmax(0.5, True)) == "ScaledMaskedSoftmax(scale=0.5, causal=True)"
    torch.testing.assert_close(opforge.nn.Softmax(1)(x), torch.softmax(x, 1))
    torch.testing.assert_close(opforge.nn.LogSoftmax(0)(x), torch.log_softmax(x, 0))
    torch.testing.assert_close(opforge.nn.ScaledMaskedSoftmax(0.5)(x), torch.softmax(x * 0.5, -1))
    mask = torch.rand((4, 5), device=device) < 0.3
    torch.testing.assert_close(opforge.nn.ScaledMaskedSoftmax()(x, mask), opforge.scaled_masked_softmax(x, mask))


@pytest.mark.cuda
def test_cuda_graph_capture_and_replay():
    x = rand((64, 4096), device="cuda")
    long = rand((300, 40000), device="cuda")  # float32 rows longer than a block: resident clusters
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up before capture, as torch asks
        opforge.softmax(x)
        opforge.scaled_masked_softmax(x, causal=True)
        opforge.softmax(long)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = opforge.softmax(x)
        out2 = opforge.scaled_masked_softmax(x, None, 0.5, True)
        out3 = opforge.softmax(long)
    x.copy_(rand((64, 4096), device="cuda"))
    long.copy_(rand((300, 40000), device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, torch.softmax(x, -1))
    torch.testing.assert_close(out2, ref_smsm(x, None, 0.5, True).cuda())
    torch.testing.assert_close(out3, torch.softmax(long, -1))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(8, 262144), (2, 1 << 20), (1, 3_000_001)])
def test_cuda_long_rows(dtype, shape):
    for name in OPS:
        check(name, rand(shape, dtype, "cuda", scale=3.0), -1)
    y = opforge.softmax(rand(shape, dtype, "cuda"))
    g = rand(shape, dtype, "cuda")
    check_bwd("softmax", torch.ops.opforge._softmax_backward(g, y, -1), g, y, -1)


@pytest.mark.cuda
def test_cuda_misaligned_vector_fallback():
    for dtype in (torch.float32, torch.bfloat16):
        flat = rand((4 * 4096 + 1,), dtype, "cuda")
        x = flat[1:].view(4, 4096)  # contiguous, but rows start off the 16-byte grid
        assert x.is_contiguous() and x.data_ptr() % 16 != 0
        check("softmax", x, -1)
        check("log_softmax", x, -1)
        check_smsm(x.view(1, 4, 4096), None, 0.5, causal=True)
        y = opforge.softmax(x)
        g = rand((4, 4096), dtype, "cuda")
        check_bwd("softmax", torch.ops.opforge._softmax_backward(g, y, -1), g, y, -1)


# Explicit launch plans (threads per row, rows per block, vectors per thread,
# cluster): every kind of plan the default heuristic may choose, on row
# lengths that fill a block exactly, partly, or spill into a last chunk.
# float16 and bfloat16 hold their values packed: up to 16 vectors (128
# values) per thread forward, 8 backward.
PLANS = [
    (64, (32, 4, 1, False)),  # warp per row, several rows per block
    (64, (8, 16, 4, False)),  # a slice of a warp per row
    (13, (1, 128, 16, False)),  # a thread per row holding the row (scalar loads: 13 is odd)
    (4096, (256, 1, 4, False)),  # block per row
    (40000, (512, 1, 4, True)),  # cluster of several blocks (or split where clusters are unavailable)
    (70001, (512, 1, 8, True)),  # cluster past 8 blocks for scalar loads
    (40000, (256, 1, 2, False)),  # two-pass split
    (3000, (128, 1, 8, False)),  # rows shorter than the block holds
    (70000, (256, 1, 16, True)),  # clusters of threads holding 64 registers of values
    (300000, (128, 1, 16, False)),  # two-pass split of long chunks
]


def max_vectors(dtype, K, arrays):
    """The kernels' limit: 64 registers of `arrays` opmath values per element (1 forward, 2 backward),
    or of values as loaded, two per register (16-byte vectors of 2-byte types)."""
    size = torch.empty((), dtype=dtype).element_size()
    width = 16 // size
    v = width if K % width == 0 else 1  # 16-byte vectors only when rows keep the alignment
    words_per_vec = v // 2 * arrays if size == 2 and v > 1 else v * arrays * (2 if size == 8 else 1)
    it = 16
    while it > 1 and it * words_per_vec > 64:
        it //= 2
    return it


def plan_rows(dtype, K):
    """Rows for an explicit plan: several times what the GPU holds at once, one -inf entry."""
    M = 6_000_000 // K + 7
    x = rand((M, K), dtype, "cuda", scale=3.0)
    x[1, K // 3] = float("-inf")
    return M, x


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("K,plan", PLANS)
def test_cuda_explicit_plans(dtype, K, plan):
    M, x = plan_rows(dtype, K)
    tpr, rpb, vectors, cluster = plan
    with poisoned("cuda"):
        y = torch.ops.opforge_bench.softmax_plan(x, tpr, rpb, min(vectors, max_vectors(dtype, K, 1)), cluster)
    check_fwd("softmax", y, x, -1)
    g = rand((M, K), dtype, "cuda")
    vectors = min(vectors, max_vectors(dtype, K, 2))
    with poisoned("cuda"):
        gx = torch.ops.opforge_bench.softmax_backward_plan(g, y, tpr, rpb, vectors, cluster)
    check_bwd("softmax", gx, g, y, -1)


# Resident clusters (persistent forward plans): each cluster walks several
# rows (more rows than clusters fit on the GPU, not a multiple of them), so
# both slot sets and the hand-over of the next row's staged loads are
# exercised, on rows with special values in some chunks only. Built for
# float32 in 16-byte vectors; other dtypes (bfloat16 here) and odd rows run
# the same plan as a cluster per row.
RESIDENT_PLANS = [
    (40000, (512, 1, 4)),  # clusters of several blocks
    (40000, (256, 1, 8)),  # clusters of 256-thread blocks, last chunk partly filled
    (70001, (512, 1, 8)),  # scalar loads (odd K): a cluster per row instead
    (65536, (512, 1, 16)),  # 64 registers of values per thread
    (4096, (256, 1, 4)),  # a resident block per row (a cluster of one)
    (3000, (128, 1, 8)),  # rows shorter than the block holds
]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K,plan", RESIDENT_PLANS)
def test_cuda_resident_cluster_plans(dtype, K, plan):
    M, x = plan_rows(dtype, K)
    x[2] = float("-inf")  # a whole row of -inf: NaN, as torch
    x[3, : K // 2] = float("-inf")  # chunks of only -inf beside finite ones
    x[4, 7] = float("nan")
    x[M - 1, K - 1] = float("inf")
    tpr, rpb, vectors = plan
    with poisoned("cuda"):
        y = torch.ops.opforge_bench.softmax_plan(x, tpr, rpb, min(vectors, max_vectors(dtype, K, 1)), True, True)
    check_fwd("softmax", y, x, -1, equal_nan=True)
    assert y[2].isnan().all() and y[4].isnan().all() and y[M - 1].isnan().all() and not y[3].isnan().any()
    assert (y[3, : K // 2] == 0).all()


# Backward plans split over a cluster of more than 8 blocks, or asking for
# more vectors per thread than dy and y together fit, hold y only (dy is
# read again for dx): up to the forward's vectors per thread, 16 in 16-byte
# vectors. The same request on rows one block holds, or rows longer than a
# cluster of 16 holds, runs with both arrays held, at their limit.
BWD_CLUSTER_PLANS = [
    (200000, (512, 1, 16)),  # clusters of blocks holding 64 registers of y
    (65536, (256, 1, 4)),  # the fewest vectors the y-only kernel takes: float32 in 16 blocks
    (131072, (256, 1, 4)),  # likewise the 2-byte types (float64: the split)
    (3000, (512, 1, 16)),  # one block holds the row: both arrays, 8 vectors
    (1_200_000, (512, 1, 16)),  # longer than a cluster holds: the split, 8 vectors
]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("K,plan", BWD_CLUSTER_PLANS)
def test_cuda_backward_cluster_plans(dtype, K, plan):
    M = max(3, 2_000_000 // K)
    y = opforge.softmax(rand((M, K), dtype, "cuda", scale=3.0))
    g = rand((M, K), dtype, "cuda")
    tpr, rpb, vectors = plan
    with poisoned("cuda"):
        gx = torch.ops.opforge_bench.softmax_backward_plan(g, y, tpr, rpb, min(vectors, max_vectors(dtype, K, 1)), True)
    check_bwd("softmax", gx, g, y, -1)


@pytest.mark.cuda
@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,K", [(203, 40000), (7, 500000)])
def test_cuda_long_rows_default_plan(name, dtype, M, K):
    """Rows longer than one block (the default's resident clusters) over more rows than clusters;
    rows of 500000, which a cluster holds in the backward only with y alone (float32: 16 x 512 x 64)."""
    x = rand((M, K), dtype, "cuda", scale=3.0)
    x[5, : K // 2] = float("-inf")
    y = check(name, x, -1)
    g = rand((M, K), dtype, "cuda")
    backward = torch.ops.opforge._softmax_backward if name == "softmax" else torch.ops.opforge._log_softmax_backward
    check_bwd(name, backward(g, y, -1), g, y, -1)


@pytest.mark.cuda
def test_cuda_explicit_plan_errors():
    x = torch.randn(4, 1024, device="cuda")
    with pytest.raises(ValueError, match="threads_per_row must be a power of two in \\[1, 512\\], got 48"):
        torch.ops.opforge_bench.softmax_plan(x, 48, 1, 1, False)
    with pytest.raises(ValueError, match="rows_per_block must be a power of two with rows_per_block x threads_per_row"):
        torch.ops.opforge_bench.softmax_plan(x, 256, 4, 1, False)
    with pytest.raises(ValueError, match="vectors_per_thread must be a power of two <= 16 .* got 32"):
        torch.ops.opforge_bench.softmax_plan(x, 32, 1, 32, False)
    with pytest.raises(ValueError, match="a plan that splits rows or keeps clusters resident needs one row per block"):
        torch.ops.opforge_bench.softmax_plan(x, 32, 4, 1, False)
    with pytest.raises(ValueError, match="threads_per_row must be in \\[1, 512\\], got 0"):
        torch.ops.opforge_bench.softmax_plan(x, 0, 1, 1, False)
    with pytest.raises(ValueError, match="persistent clusters need cluster=True"):
        torch.ops.opforge_bench.softmax_plan(x, 256, 1, 1, False, True)
