"""opforge's N-input elementwise helpers (include/opforge/elementwise.h, cpu_loops.h,
cpu_elementwise.h, cuda_loops.cuh), through a small extension built with them
(tests/elementwise_ext): fma3(x, y, z) = x * y + z, and gelu_bias(x, bias) =
gelu_tanh(x + bias) whose backward reads (grad, x, bias).

The extension is JIT-built once into build/elementwise-ext/ (ninja rebuilds only what
changed; a warm run loads it in about a second). CPU loops of each ISA this CPU runs
are checked, the CUDA kernels where a GPU is visible.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo.testing
import torch.nn.functional as F
from cpu_isa import ORDER, native
from reference import DTYPES, assert_close, assert_within, poisoned, rand, unit_roundoff

from opforge import extension

REPO = Path(__file__).resolve().parents[1]
EXT = Path(__file__).resolve().parent / "elementwise_ext"
SOURCES = extension.SourceSet(
    name="opforge_nary_test",
    root=EXT,
    cpu_sources=["ops.cpp", "cpu/isa_default.cpp", "cpu/isa_avx2.cpp", "cpu/isa_avx512.cpp"],
    cuda_sources=["cuda/ops.cu"],
    include_dirs=["."],
)
# Half an ulp relative to the value: the most one rounding to the dtype changes it.
ROUNDING = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def rounding(dtype, value):
    """The most rounding `value` (float64) to `dtype` changes it: half an ulp, and at least
    half the subnormal spacing (float16 results of 1e-5 are subnormal)."""
    info = torch.finfo(dtype)
    return ROUNDING[dtype] * value.abs() + 0.5 * info.smallest_normal * info.eps


@pytest.fixture(scope="module")
def library() -> str:
    saved = os.environ.get("TORCH_EXTENSIONS_DIR")
    os.environ["TORCH_EXTENSIONS_DIR"] = str(REPO / "build" / "elementwise-ext")
    try:
        return extension.jit_load(SOURCES, require_gpu=True)
    finally:
        if saved is None:
            os.environ.pop("TORCH_EXTENSIONS_DIR")
        else:
            os.environ["TORCH_EXTENSIONS_DIR"] = saved


@pytest.fixture(scope="module")
def ops(library):
    return torch.ops.opforge_nary_test


def check_fma3(ops, x, y, z):
    """Values against float64 (rounded once to the result dtype), and torch's own result
    dtype and memory layout for the same inputs (addcmul: z + x * y through one iterator)."""
    with poisoned(x.device):
        out = ops.fma3(x, y, z)
    theirs = torch.addcmul(z, x, y)
    exact = torch.addcmul(z.cpu().double(), x.cpu().double(), y.cpu().double())
    assert out.dtype == theirs.dtype and out.shape == theirs.shape and out.device == x.device
    assert out.stride() == theirs.stride(), (out.stride(), theirs.stride())
    assert_close(out.cpu(), exact.to(out.dtype))
    return out


# ----------------------------------------------------------------------------- fma3


LAYOUTS = {
    # name: (x, y, z) factories over (dtype, device)
    "flat": lambda d, v: [rand((1003,), d, v) for _ in range(3)],
    # Several parallel chunks of the flat loop (GRAIN_SIZE is 32768), each with a tail.
    "flat_chunks": lambda d, v: [rand(((1 << 17) + 5,), d, v) for _ in range(3)],
    "broadcast": lambda d, v: [rand((4, 3, 37), d, v), rand((3, 1), d, v), rand((37,), d, v)],
    "inner_scalar": lambda d, v: [rand((64, 70), d, v), rand((64, 1), d, v), rand((), d, v)],
    "two_inner_scalars": lambda d, v: [rand((5, 1), d, v), rand((5, 67), d, v), rand((5, 1), d, v)],
    "all_scalar": lambda d, v: [rand((), d, v) for _ in range(3)],
    "strided": lambda d, v: [
        rand((48, 64), d, v)[:, ::2],
        rand((32, 48), d, v).t(),
        rand((1, 32), d, v).expand(48, 32),
    ],
    "misaligned": lambda d, v: [rand((301,), d, v)[1:], rand((300,), d, v), rand((302,), d, v)[2:]],
    "channels_last": lambda d, v: [
        rand((2, 6, 5, 7), d, v).to(memory_format=torch.channels_last),
        rand((6, 1, 1), d, v),
        rand((2, 6, 5, 7), d, v).to(memory_format=torch.channels_last),
    ],
    "empty": lambda d, v: [rand((0, 5), d, v), rand((5,), d, v), rand((1, 5), d, v)],
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fma3_values(ops, layout, dtype, device):
    out = check_fma3(ops, *LAYOUTS[layout](dtype, device))
    if layout == "channels_last":
        assert out.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize(
    "dtypes", [(torch.float16, torch.float32, torch.float16), (torch.bfloat16, torch.float16, torch.bfloat16)]
)
def test_fma3_promotes_like_torch(ops, dtypes, device):
    x, y, z = (rand((3, 33), d, device) for d in dtypes)
    check_fma3(ops, x, y, z)
    # A 0-d input of a higher dtype does not promote dimensioned ones (torch's rule).
    check_fma3(ops, x, rand((), torch.float64, device), z)


def test_fma3_bad_inputs_name_the_argument(ops):
    x, y = rand((3, 4)), rand((4,))
    with pytest.raises(TypeError, match=r"opforge_nary_test.fma3: z must be a float32, .* got torch.int64"):
        ops.fma3(x, y, torch.ones(4, dtype=torch.int64))
    with pytest.raises(TypeError, match=r"opforge_nary_test.fma3: x must be a float32, .* got torch.bool"):
        ops.fma3(torch.ones(4, dtype=torch.bool), y, y)
    msg = r"x with shape \[3, 4\] and z with shape \[5\] are not broadcastable \(dimension 1: 4 vs 5\)"
    with pytest.raises(RuntimeError, match=msg):
        ops.fma3(x, y, rand((5,)))
    msg = r"y with shape \[2, 1\] and z with shape \[3, 4\] are not broadcastable \(dimension 0: 2 vs 3\)"
    with pytest.raises(RuntimeError, match=msg):
        ops.fma3(rand((4,)), rand((2, 1)), x)
    with pytest.raises(RuntimeError, match=r"x and y must be on the same device, got x on cpu and y on meta"):
        ops.fma3(x, y.to("meta"), y)


# ----------------------------------------------------------------------------- gelu_bias


def gelu_ref(x, bias):
    return F.gelu(x.double() + bias.double(), approximate="tanh")


GELU_LAYOUTS = {
    "flat": lambda d, v: (rand((513,), d, v), rand((513,), d, v)),
    "rows": lambda d, v: (rand((33, 40), d, v), rand((40,), d, v)),
    "columns": lambda d, v: (rand((6, 70), d, v), rand((6, 1), d, v)),
    "channels_last": lambda d, v: (
        rand((2, 8, 3, 5), d, v).to(memory_format=torch.channels_last),
        rand((8, 1, 1), d, v),
    ),
    "strided": lambda d, v: (rand((40, 30), d, v).t()[:, ::3], rand((), d, v)),
    "empty": lambda d, v: (rand((0, 4), d, v), rand((4,), d, v)),
}


BETA, KAPPA = math.sqrt(2 / math.pi), 0.044715


def gelu_grad_error(grad, z, dtype):
    """Allowed error of grad * gelu_tanh'(z) (float64 tensors) computed in `dtype`'s opmath and
    rounded once to `dtype`: 8 u times the sum of the absolute values of its terms (each of
    its dozen roundings is at most u relative to the term it lands in; tanh(u) for large |z|
    makes 1 - t^2 cancel), plus the final rounding."""
    t = torch.tanh(BETA * (z + KAPPA * z**3))
    du = BETA * (1 + 3 * KAPPA * z**2)
    terms = grad.abs() * (0.5 * (1 + t.abs()) + 0.5 * z.abs() * (1 + t**2) * du)
    exact = grad * (0.5 * (1 + t) + 0.5 * z * (1 - t**2) * du)
    return 8 * unit_roundoff(dtype) * terms + rounding(dtype, exact)


def reduced_error(elementwise, full, shape, dtype):
    """Allowed error of full.sum_to_size(shape) (torch's sum, accumulated in opmath), where each
    element of `full` was off by up to `elementwise`: those errors add up, the K - 1 additions
    of each output add at most K u times the sum of the magnitudes (the worst-case bound, which
    grows with the reduction), and the result is rounded once."""
    k = full.numel() // max(1, math.prod(shape)) if full.numel() else 0
    summed = full.abs().sum_to_size(shape)
    return elementwise.sum_to_size(shape) + k * unit_roundoff(dtype) * summed + rounding(dtype, full.sum_to_size(shape))


@pytest.mark.parametrize("layout", GELU_LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_bias_forward_and_backward(ops, layout, dtype, device):
    x, bias = GELU_LAYOUTS[layout](dtype, device)
    x.requires_grad_(True)
    bias.requires_grad_(True)
    with poisoned(device):
        out = ops.gelu_bias(x, bias)
    theirs = F.gelu(x + bias, approximate="tanh")
    assert out.dtype == theirs.dtype and out.stride() == theirs.stride()
    x64, b64 = (t.detach().cpu().double().requires_grad_(True) for t in (x, bias))
    exact = gelu_ref(x64, b64)
    assert_close(out.detach().cpu(), exact.to(dtype))

    grad = rand(out.shape, dtype, device)
    with poisoned(device):
        gx, gb = torch.autograd.grad(out, (x, bias), grad)
    ex, eb = torch.autograd.grad(exact, (x64, b64), grad.cpu().double())
    assert gx.shape == x.shape and gb.shape == bias.shape and gx.dtype == dtype and gb.dtype == dtype
    g64, z64 = grad.cpu().double(), (x64 + b64).detach()
    elem = gelu_grad_error(g64, z64, dtype)
    dz = torch.autograd.grad(gelu_ref(z64.requires_grad_(True), torch.zeros(())), z64, g64)[0]
    assert_within(gx.cpu().double(), ex, reduced_error(elem, dz, x.shape, dtype))
    assert_within(gb.cpu().double(), eb, reduced_error(elem, dz, bias.shape, dtype))


def test_gelu_backward_reads_the_inputs(ops, device):
    # The backward op on its own: grad * gelu'(x + bias), full size, from the inputs.
    grad, x, bias = rand((7, 9), device=device), rand((7, 9), device=device), rand((9,), device=device)
    with poisoned(device):
        out = ops._gelu_bias_backward(grad, x, bias)
    z = (x.double() + bias.double()).requires_grad_(True)
    (exact,) = torch.autograd.grad(F.gelu(z, approximate="tanh"), z, grad.double())
    assert_within(out.cpu().double(), exact, gelu_grad_error(grad.double(), z.detach(), torch.float32))


def test_gelu_bias_gradcheck(ops, device):
    x = rand((3, 4, 5), torch.float64, device).requires_grad_(True)
    bias = rand((4, 1), torch.float64, device).requires_grad_(True)
    assert torch.autograd.gradcheck(ops.gelu_bias, (x, bias))


def test_opcheck(ops, device):
    for x, y, z in (LAYOUTS["broadcast"](torch.float32, device), LAYOUTS["channels_last"](torch.float32, device)):
        torch.library.opcheck(ops.fma3.default, (x, y, z))
        torch.library.opcheck(ops._gelu_bias_backward.default, (x, y, z))
        leaves = [t.detach().clone(memory_format=torch.preserve_format).requires_grad_(True) for t in (x, y)]
        torch.library.opcheck(ops.gelu_bias.default, tuple(leaves))


def test_compile_fullgraph_dynamic(ops, device):
    # fma3 has no autograd (forward only): it takes no input that requires grad.
    def model(x, bias, y):
        return ops.gelu_bias(x, bias).sum() + ops.fma3(x.detach(), y, bias.detach()).sum()

    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=True)
    for rows in (5, 9):
        args = [rand((rows, 16), device=device), rand((16,), device=device), rand((rows, 1), device=device)]
        ours = [a.clone().requires_grad_(i < 2) for i, a in enumerate(args)]
        eager = [a.clone().requires_grad_(i < 2) for i, a in enumerate(args)]
        got, want = compiled(*ours), model(*eager)
        torch.testing.assert_close(got, want)
        got.backward()
        want.backward()
        for a, b in zip(ours[:2], eager[:2]):
            assert a.grad is not None and b.grad is not None
            torch.testing.assert_close(a.grad, b.grad)
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} frames"


# ----------------------------------------------------------------------------- each ISA's loops

ISA_CODE = r"""
import sys, torch
import torch._dynamo.testing
import torch.nn.functional as F
torch.ops.load_library(sys.argv[1])
ops = torch.ops.opforge_nary_test
torch.manual_seed(int(sys.argv[2]))
worst = 0.0
for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float64, 1e-12)):
    for shapes in (((1003,), (1003,), (1003,)), ((40, 37), (40, 1), (37,)), ((6, 70), (6, 1), (6, 1))):
        x, y, z = (torch.randn(s, dtype=torch.float64).to(dtype) for s in shapes)
        got = ops.fma3(x, y, z).double()
        want = x.double() * y.double() + z.double()
        worst = max(worst, float(((got - want).abs() / (want.abs() + 1)).max()) / tol)
        got = ops._gelu_bias_backward(z, x, y).double()
        t = (x.double() + y.double()).requires_grad_(True)
        (want,) = torch.autograd.grad(F.gelu(t, approximate="tanh"), t, z.double().expand_as(t))
        worst = max(worst, float(((got - want).abs() / (want.abs() + 1)).max()) / (8 * tol))
print("isa", ops.cpu_isa(), "worst", worst)
"""


@pytest.mark.parametrize("capability", ORDER)
def test_each_isa_loops(library, ops, capability):
    best = native().lower()
    if ORDER.index(capability) > ORDER.index(best):
        pytest.skip(f"this CPU runs at most {best.upper()}: the {capability.upper()} loops cannot run here")
    if capability == best:
        assert ops.cpu_isa() == ORDER.index(best)  # this process runs the best loops
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    seed = os.environ.get("OPFORGE_TEST_CASE_SEED", "0")
    proc = subprocess.run(
        [sys.executable, "-c", ISA_CODE, library, seed], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    words = proc.stdout.split()
    assert words[:2] == ["isa", str(ORDER.index(capability))], proc.stdout
    assert float(words[3]) <= 1.0 and not math.isnan(float(words[3])), proc.stdout
