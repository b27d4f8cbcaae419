"""opforge.conv2d_3x3 on CUDA: the kernels' tile and engine choices, aligned and offset views, graphs."""

import math

import pytest
import torch
import torch.nn.functional as F
from conv_check import CONFIGS, check, reference
from reference import TOLERANCES, rand

import opforge


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(4, 64, 56, 56), (2, 256, 28, 28), (2, 128, 112, 112), (1, 8, 300, 700)])
@pytest.mark.parametrize("channels_last", [False, True])
def test_cuda_depthwise_bench_shapes(dtype, shape, channels_last):
    x = rand(shape, dtype, "cuda")
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    c = shape[1]
    for stride in (1, 2):
        check(x, rand((c, 1, 3, 3), dtype, "cuda"), rand((c,), dtype, "cuda"), stride, 1, c, True)
    x1 = x.detach().clone().requires_grad_()
    w = rand((c, 1, 3, 3), dtype, "cuda").requires_grad_()
    out = opforge.conv2d_3x3(x1, w, None, 1, 1, c, "relu")
    g = rand(out.shape, dtype, "cuda")
    out.backward(g)
    x2, w2 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    torch.relu(F.conv2d(x2, w2, None, 1, 1, 1, c)).backward(g.double() * (out.detach() > 0).double())
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(x1.grad.double(), x2.grad, atol=atol * 3, rtol=rtol)
    n_terms = shape[0] * shape[2] * shape[3]
    torch.testing.assert_close(w.grad.double(), w2.grad, atol=atol * math.sqrt(n_terms), rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("stride", [1, 2])
def test_depthwise_multiplier_vector_paths(dtype, channels_last, stride, device):
    # Channel multiplier 2 with sizes that allow 16-byte accesses along W and C.
    x = rand((2, 16, 12, 32), dtype, device)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    check(x, rand((32, 1, 3, 3), dtype, device), rand((32,), dtype, device), stride, 1, 16, True)


@pytest.mark.cuda
@pytest.mark.parametrize("channels_last", [False, True])
def test_cuda_misaligned_and_offset_views(channels_last):
    # A storage offset of one element breaks 16-byte alignment although W and
    # C are multiples of the vector width: the kernels must take narrower accesses.
    shape = (2, 8, 10, 16)
    base = rand((2 * 8 * 10 * 16 + 1,), torch.float32, "cuda")
    if channels_last:
        x = base[1:].view(2, 10, 16, 8).permute(0, 3, 1, 2)
    else:
        x = base[1:].view(shape)
    assert x.data_ptr() % 16 != 0
    check(x, rand((8, 1, 3, 3), torch.float32, "cuda"), None, 1, 1, 8, True)
    check(x, rand((8, 8, 3, 3), torch.float32, "cuda"), rand((8,), torch.float32, "cuda"), 1, 1, 1, True)


@pytest.mark.cuda
def test_cuda_graph_capture_and_replay():
    x = rand((4, 32, 20, 20), device="cuda")
    w = rand((32, 1, 3, 3), device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        opforge.conv2d_3x3(x, w, None, 1, 1, 32, "relu")
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = opforge.conv2d_3x3(x, w, None, 1, 1, 32, "relu")
    x.copy_(rand((4, 32, 20, 20), device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.double().cpu(), reference(x, w, None, 1, 1, 32, True), atol=1e-5, rtol=1e-5)


# Stride-1 depthwise CUDA kernels: each case pins one of the host's tile
# choices (noted for a GPU of 132 SMs; every case is valid on any GPU).
S1_NCHW_CASES = [
    # (shape, multiplier, padding)
    ((2, 3, 56, 56), 1, 1),  # 16-byte row copies, V = 16 bytes, vector stores
    ((2, 3, 28, 28), 1, 1),  # half types: Wo % 8 != 0 -> V = 4, 8-byte row copies
    ((1, 4, 9, 30), 1, 0),  # 4-byte (half) / 8-byte (float) row copies; float V = 2
    ((1, 4, 7, 31), 1, 1),  # odd width: element (half) / 4-byte copies, scalar stores
    ((2, 1101, 10, 10), 1, 1),  # 4 planes per block, the last block with 2
    ((1, 3, 201, 1500), 1, 0),  # bands of rows (float32: 34 bands of 6, the last a single row)
    ((1, 2, 5, 13000), 1, 1),  # a row too wide to stage: the tiled fallback
    ((2, 5, 13, 20), 3, 1),  # channel multiplier 3 from one stage
    ((2, 5, 12, 16), 2, 0),  # multiplier 2, padding 0, vector stores
    ((1, 2, 3, 3), 1, 0),  # a 1x1 output
    ((1, 2, 3, 4), 1, 1),  # fewer columns than one vector
]

S1_NHWC_CASES = [
    # (shape, padding); small problems take tiles of 4-8 rows, (16, 64, 56, 56) of 14
    ((2, 32, 20, 20), 1),  # one 32-channel chunk, two tile columns of 10
    ((1, 64, 37, 17), 1),  # two chunks, partial last tiles (tile columns of 9 and 8)
    ((2, 40, 9, 12), 0),  # a partial channel chunk (8 of 32)
    ((1, 12, 8, 8), 1),  # C < 32: 8-byte copies for the half types
    ((1, 4, 5, 6), 0),  # C = 4
    ((1, 6, 8, 8), 1),  # C % 4 != 0: the tiled fallback
    ((1, 16, 40, 3), 1),  # one tile column of 3
    ((16, 64, 56, 56), 1),  # enough blocks for the full 16-row tiles (4 x 4 tiles of 14 x 14)
]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,mult,padding", S1_NCHW_CASES)
@pytest.mark.parametrize("relu", [False, True])
def test_cuda_depthwise_stride1_nchw_tiles(dtype, shape, mult, padding, relu):
    c = shape[1]
    x = rand(shape, dtype, "cuda")
    w = rand((c * mult, 1, 3, 3), dtype, "cuda")
    check(x, w, rand((c * mult,), dtype, "cuda"), 1, padding, c, relu)
    check(x, w, None, 1, padding, c, relu)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,padding", S1_NHWC_CASES)
@pytest.mark.parametrize("relu", [False, True])
def test_cuda_depthwise_stride1_nhwc_tiles(dtype, shape, padding, relu):
    c = shape[1]
    x = rand(shape, dtype, "cuda").to(memory_format=torch.channels_last)
    w = rand((c, 1, 3, 3), dtype, "cuda")
    check(x, w, rand((c,), dtype, "cuda"), 1, padding, c, relu)
    check(x, w, None, 1, padding, c, relu)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("channels_last", [False, True])
def test_cuda_depthwise_stride1_offset_views(dtype, channels_last):
    # One element of storage offset: 16-byte copies are off; float32 takes
    # 4-byte copies, bfloat16 element copies (NCHW) or the tiled fallback (NHWC).
    n, c, h, w = 2, 16, 12, 32
    base = rand((n * c * h * w + 1,), dtype, "cuda")
    if channels_last:
        x = base[1:].view(n, h, w, c).permute(0, 3, 1, 2)
    else:
        x = base[1:].view(n, c, h, w)
    assert x.data_ptr() % 16 != 0
    for padding in (0, 1):
        check(x, rand((c, 1, 3, 3), dtype, "cuda"), rand((c,), dtype, "cuda"), 1, padding, c, True)


@pytest.mark.cuda
@pytest.mark.parametrize("engine", ["cudnn", "opforge"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("channels_last", [False, True])
def test_cuda_dense_engines(engine, dtype, channels_last, monkeypatch):
    """Dense convolutions through cuDNN (the default: its fused kernel with ReLU)
    and through this library's tensor-core kernel (OPFORGE_CONV_DENSE_ENGINE=opforge)."""
    monkeypatch.setenv("OPFORGE_CONV_DENSE_ENGINE", engine)
    for stride, padding in CONFIGS:
        x = rand((2, 32, 13, 18), dtype, "cuda")
        if channels_last:
            x = x.to(memory_format=torch.channels_last)
        for relu in (True, False):
            check(x, rand((40, 32, 3, 3), dtype, "cuda"), rand((40,), dtype, "cuda"), stride, padding, 1, relu)
            check(x, rand((40, 32, 3, 3), dtype, "cuda"), None, stride, padding, 1, relu)


@pytest.mark.cuda
def test_cuda_dense_engine_bad_value(monkeypatch):
    monkeypatch.setenv("OPFORGE_CONV_DENSE_ENGINE", "fastest")
    x = rand((1, 8, 6, 6), torch.float32, "cuda")
    with pytest.raises(ValueError, match='OPFORGE_CONV_DENSE_ENGINE must be "cudnn" or "opforge", got "fastest"'):
        opforge.conv2d_3x3(x, rand((8, 8, 3, 3), torch.float32, "cuda"), None, activation="relu")
