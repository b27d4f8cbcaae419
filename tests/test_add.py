"""opforge.add / opforge.add_relu and their fused backward."""

import pytest
import torch
from cpu_isa import native, picked_isa, run_capped
from reference import DTYPES, poisoned, rand

import opforge

OPS = {
    "add": (opforge.add, lambda a, b: a + b),
    "add_relu": (opforge.add_relu, lambda a, b: torch.relu(a + b)),
}
SHAPES = [(), (0,), (1,), (7,), (33,), (1023,), (4, 33), (2, 3, 5, 7), ((1 << 16) + 3,)]


def reference(name, a, b):
    """Exact result: inputs converted to torch's result dtype (as torch does),
    summed in float64, rounded once."""
    out_dtype = torch.result_type(a, b)
    a64, b64 = (t.to(out_dtype).double().cpu() for t in (a, b))
    return OPS[name][1](a64, b64).to(out_dtype)


def check_exact(name, a, b):
    # Both ops round the exact sum once, so they must equal the float64
    # reference bit for bit (NaN never equals).
    with poisoned(a.device):
        out = OPS[name][0](a, b)
    expected = reference(name, a, b)
    assert out.dtype == expected.dtype and out.shape == expected.shape and out.device == a.device
    assert torch.equal(out.cpu(), expected), (out, expected)
    return out


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_values(name, dtype, shape, device):
    check_exact(name, rand(shape, dtype, device), rand(shape, dtype, device))


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize(
    "sa,sb", [((3, 1, 5), (4, 5)), ((5,), (2, 3, 5)), ((), (4, 4)), ((2, 1), (1, 3)), ((0, 3), (3,)), ((6, 1), ())]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_broadcasting(name, sa, sb, dtype, device):
    check_exact(name, rand(sa, dtype, device), rand(sb, dtype, device))


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_and_expanded(name, dtype, device):
    base = rand((64, 48), dtype, device)
    check_exact(name, base.t(), rand((48, 64), dtype, device))  # transposed
    check_exact(name, base[::2, 1::3], rand((32, 16), dtype, device))  # sliced
    check_exact(name, rand((1, 48), dtype, device).expand(64, 48), base)  # zero stride
    check_exact(name, base[:, 1:], rand((64, 47), dtype, device))  # misaligned start
    check_exact(name, rand((), dtype, device).expand(5, 7), rand((5, 7), dtype, device).t().t())


@pytest.mark.parametrize("name", OPS)
def test_memory_format_follows_torch(name, device):
    a = rand((2, 8, 5, 6), device=device).to(memory_format=torch.channels_last)
    b = rand((2, 8, 5, 6), device=device).to(memory_format=torch.channels_last)
    out = check_exact(name, a, b)
    assert out.stride() == (a + b).stride()
    c = rand((8, 1, 1), device=device)
    out = check_exact(name, a, c)
    assert out.stride() == (a + c).stride()


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_and_inf_as_torch(name, dtype, device):
    a = torch.tensor(
        [float("nan"), float("inf"), float("-inf"), float("inf"), 1.0, -1.0, float("nan")], dtype=dtype, device=device
    )
    b = torch.tensor(
        [1.0, 1.0, 1.0, float("-inf"), float("inf"), float("-inf"), float("nan")], dtype=dtype, device=device
    )
    out = OPS[name][0](a, b)
    torch.testing.assert_close(out, OPS[name][1](a, b), equal_nan=True, atol=0, rtol=0)


@pytest.mark.parametrize("name", OPS)
def test_mixed_dtypes_follow_torch_promotion(name, device):
    check_exact(name, rand((5, 3), torch.float16, device), rand((5, 3), torch.float32, device))
    check_exact(name, rand((5, 3), torch.bfloat16, device), rand((5, 3), torch.float16, device))
    # A 0-dim tensor does not widen a dimensioned one (torch's rule).
    out = check_exact(name, rand((4,), torch.float32, device), rand((), torch.float64, device))
    assert out.dtype == torch.float32


# --------------------------------------------------------------------------- errors


# The public wrapper and the registered op: the same checks (in C++), the same message.
CALLERS = {
    "wrapper": lambda name: getattr(opforge, name),
    "torch.ops": lambda name: getattr(torch.ops.opforge, name),
}


@pytest.mark.parametrize("caller", CALLERS)
@pytest.mark.parametrize("name", ["add", "add_relu"])
def test_bad_inputs_raise_clear_errors(name, caller):
    fn = CALLERS[caller](name)
    x = torch.randn(3)
    op = f"opforge.{name}"
    with pytest.raises(
        TypeError, match=rf"^{op}: a must be a float32, float64, float16 or bfloat16 tensor, got torch.int64$"
    ):
        fn(torch.arange(3), x)
    with pytest.raises(TypeError, match=rf"^{op}: b must be a float32.* got torch.bool$"):
        fn(x, torch.ones(3, dtype=torch.bool))
    # Shapes that do not broadcast: RuntimeError, as torch.add raises.
    with pytest.raises(RuntimeError, match=rf"^{op}: a with shape \[3\] and b with shape \[4\] are not broadcastable"):
        fn(x, torch.randn(4))
    # Not a tensor nor a number: torch's argument parser refuses it, naming the argument.
    with pytest.raises(RuntimeError, match=r"argument 'a'.*found type 'list'"):
        fn([1.0], x)
    with pytest.raises(RuntimeError, match=r"failed to match any schema"):
        fn(1.0, 2.0)


@pytest.mark.parametrize("op", ["add", "add_relu", "_add_relu_backward"])
def test_raw_op_checks_in_cpp(op):
    raw = getattr(torch.ops.opforge, op).default
    with pytest.raises(TypeError, match=r"must be a float32, float64, float16 or bfloat16 tensor, got torch.int32"):
        raw(torch.ones(3, dtype=torch.int32), torch.ones(3))
    with pytest.raises(RuntimeError, match=r"with shape \[2, 3\] and .* with shape \[4\] are not broadcastable"):
        raw(torch.ones(2, 3), torch.ones(4))


def test_shape_error_is_the_same_under_compile():
    # The shape function runs the kernels' C++ check, so torch.compile
    # reports what eager reports (with symbolic sizes under dynamic shapes).
    torch._dynamo.reset()
    compiled = torch.compile(opforge.add_relu, fullgraph=True, dynamic=True)
    with pytest.raises(
        Exception, match=r"opforge.add_relu: a with shape \[\w+, \w+\] and b with shape \[\w+\] are not broadcastable"
    ):
        compiled(torch.ones(2, 3), torch.ones(4))


@pytest.mark.cuda
@pytest.mark.parametrize("fn", [opforge.add, opforge.add_relu])
def test_different_devices_raise(fn):
    with pytest.raises(RuntimeError, match=r"a and b must be on the same device, got a on cuda:0 and b on cpu"):
        fn(torch.randn(3, device="cuda"), torch.randn(3))
    with pytest.raises(RuntimeError, match=r"same device"):
        getattr(torch.ops.opforge, fn.__name__)(torch.randn(3), torch.randn(3, device="cuda"))


# --------------------------------------------------------------------------- Python numbers


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("number", [2.5, -3, True])
def test_python_number_either_side(name, dtype, number, device):
    # As torch.add: the number takes the tensor's dtype (rounded to it first).
    x = rand((5, 7), dtype, device)
    as_tensor = torch.tensor(number, dtype=dtype, device=device)
    with poisoned(device):
        right = OPS[name][0](x, number)
        left = OPS[name][0](number, x)
    for out in (right, left):
        assert out.dtype == dtype and out.shape == x.shape and out.device == x.device
        assert torch.equal(out.cpu(), reference(name, x, as_tensor))


@pytest.mark.parametrize("name", OPS)
def test_python_number_gradients(name, device):
    x = rand((4, 3), torch.float64, device).requires_grad_()
    fn = OPS[name][0]
    assert torch.autograd.gradcheck(lambda t: fn(t, 0.25), (x,))
    assert torch.autograd.gradcheck(lambda t: fn(-0.5, t), (x,))


@pytest.mark.parametrize("name", OPS)
def test_python_number_overloads_opcheck(name, device):
    x = rand((8, 3), device=device).requires_grad_()
    packet = getattr(torch.ops.opforge, name)
    torch.library.opcheck(packet.number_b, (x, 1.5))
    torch.library.opcheck(packet.number_a, (-2.0, x))


def test_python_number_under_compile(device):
    torch._dynamo.reset()
    x = rand((6, 4), device=device)
    compiled = torch.compile(lambda t: opforge.add_relu(t, 0.5) * opforge.add(2.0, t), fullgraph=True, dynamic=True)
    torch.testing.assert_close(compiled(x), torch.relu(x + 0.5) * (2.0 + x))


# --------------------------------------------------------------------------- autograd


@pytest.mark.parametrize("fn", [opforge.add, opforge.add_relu])
@pytest.mark.parametrize("sa,sb", [((4, 5), (4, 5)), ((3, 1, 5), (4, 5)), ((), (2, 3))])
def test_gradcheck(fn, sa, sb, device):
    a = rand(sa, torch.float64, device).requires_grad_()
    b = rand(sb, torch.float64, device).requires_grad_()
    assert torch.autograd.gradcheck(fn, (a, b))
    assert torch.autograd.gradgradcheck(fn, (a, b))


@pytest.mark.parametrize(
    "fn,ref", [(opforge.add, lambda a, b: a + b), (opforge.add_relu, lambda a, b: torch.relu(a + b))]
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_matches_torch(fn, ref, dtype, device):
    a = rand((6, 1, 9), dtype, device).requires_grad_()
    b = rand((5, 9), torch.float32, device).requires_grad_()  # mixed dtype + broadcast
    g = rand((6, 5, 9), torch.result_type(a, b), device)
    fn(a, b).backward(g)
    a2, b2 = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    ref(a2, b2).backward(g)
    assert a.grad.dtype == a.dtype and b.grad.dtype == b.dtype
    torch.testing.assert_close(a.grad, a2.grad)
    torch.testing.assert_close(b.grad, b2.grad)


@pytest.mark.parametrize("fn", [opforge.add, opforge.add_relu])
def test_no_grad_paths_agree(fn, device):
    # Without gradients the autograd kernel calls the op below autograd:
    # same values, no graph, also under no_grad with inputs that require grad.
    a, b = rand((9, 4), device=device).requires_grad_(), rand((4,), device=device)
    with torch.no_grad():
        out = fn(a, b)
    assert not out.requires_grad and out.grad_fn is None
    assert torch.equal(out, fn(a.detach(), b))
    assert fn(a, b).requires_grad


def test_fused_backward_op_values(device):
    grad = rand((1000,), torch.float32, device)
    result = torch.relu(rand((1000,), torch.float32, device))
    with poisoned(device):
        out = torch.ops.opforge._add_relu_backward(grad, result)
    assert torch.equal(out, torch.where(result > 0, grad, torch.zeros_like(grad)))


# --------------------------------------------------------------------------- torch.library / compile


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_opcheck(dtype, device):
    a = rand((8, 3), dtype, device).requires_grad_()
    b = rand((3,), dtype, device).requires_grad_()
    torch.library.opcheck(torch.ops.opforge.add.default, (a, b))
    torch.library.opcheck(torch.ops.opforge.add_relu.default, (a, b))
    result = torch.relu(rand((8, 3), dtype, device)).requires_grad_()
    torch.library.opcheck(torch.ops.opforge._add_relu_backward.default, (rand((8, 3), dtype, device), result))


class Residual(torch.nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.fc = torch.nn.Linear(width, width)
        self.act = opforge.nn.AddReLU()
        self.add = opforge.nn.Add()

    def forward(self, x):
        return self.add(self.act(self.fc(x), x), x)


def test_compile_fullgraph_dynamic_no_recompiles(device):
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    model = Residual().to(device)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=True)
    for batch in (3, 5, 17, 64):
        x = rand((batch, 16), device=device)
        torch.testing.assert_close(compiled(x), model(x))
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} frames"


def test_compile_backward(device):
    torch._dynamo.reset()
    model = Residual().to(device)
    compiled = torch.compile(model, fullgraph=True)
    x = rand((8, 16), device=device).requires_grad_()
    compiled(x).sum().backward()
    gx = x.grad.clone()
    x.grad = None
    model(x).sum().backward()
    torch.testing.assert_close(gx, x.grad)


def _train(act, device, seed, steps=60):
    torch.manual_seed(seed)  # the same model and data for both runs, from the test's seed
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Linear(32, 1)).to(device)
    bias = torch.nn.Parameter(torch.full((32,), 0.1, device=device))
    opt = torch.optim.Adam(list(model.parameters()) + [bias], lr=1e-2)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    x = torch.randn((256, 8), device=device, generator=gen)
    y = (x.sum(1, keepdim=True) > 0).float()
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model[1](act(model[0](x), bias)), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_nn_modules_train(device, seed):
    ours = _train(opforge.nn.AddReLU(), device, seed)
    eager = _train(lambda a, b: torch.relu(a + b), device, seed)
    assert ours[-1] < 0.5 * ours[0], ours[::10]
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(eager), atol=1e-4, rtol=1e-4)


@pytest.mark.cuda
def test_cuda_graph_capture_and_replay():
    # Kernels must launch on the current stream to be captured correctly.
    a, b = rand((1 << 20,), device="cuda"), rand((1 << 20,), device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        opforge.add_relu(a, b)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = opforge.add_relu(a, b)
    a.copy_(rand((1 << 20,), device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, torch.relu(a + b))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_tensor_vector_path(dtype):
    n = (1 << 24) + 5  # vector body plus a ragged tail
    check_exact("add_relu", rand((n,), dtype, "cuda"), rand((n,), dtype, "cuda"))


@pytest.mark.parametrize("capability", ["default", "avx2", "avx512"])
def test_every_cpu_isa_build_is_exact(capability):
    # Each ISA's loops are separate machine code: check each one, picked the
    # way torch picks its own (ATEN_CPU_CAPABILITY caps the choice).
    code = """
import torch, opforge
from opforge.ops.add import add, add_relu
for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
    for n in (1, 31, 1000, 70001):
        a = torch.randn(n, dtype=torch.float64).to(dtype)
        b = torch.randn(n, dtype=torch.float64).to(dtype)
        assert torch.equal(add(a, b), (a.double() + b.double()).to(dtype)), (dtype, n)
        assert torch.equal(add_relu(a, b), torch.relu(a.double() + b.double()).to(dtype)), (dtype, n)
        assert torch.equal(
            add_relu(a[:, None], b[None, :7]), torch.relu(a.double()[:, None] + b.double()[None, :7]).to(dtype)
        )
print("ok")
"""
    run_capped(capability, code)


def test_cpu_isa_never_beyond_the_cpu():
    # ATEN_CPU_CAPABILITY=avx512 makes torch report AVX512 even on a CPU
    # without it; opforge still picks the best loops the CPU runs (AVX-512
    # ones would stop on an illegal instruction).
    code = """
import torch, opforge
a = torch.randn(1000)
assert torch.equal(opforge.add_relu(a, a), torch.relu(a + a))
print("ok")
"""
    assert picked_isa("avx512", code) == native()
