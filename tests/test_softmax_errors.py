"""The softmax family's refusals: the wrapper, the op and its shape function raise the same clear error."""

import pytest
import torch
from reference import rand
from softmax_check import OPS

import opforge

# Every check lives once, in C++ (csrc/softmax_host.h): the public wrapper,
# the op itself and the shape function (meta tensors, as under
# torch.compile) raise the same exception with the same words.


def on_meta(args):
    return [a.to("meta") if isinstance(a, torch.Tensor) else a for a in args]


def raises_everywhere(fns, args, exc, match):
    """`exc` matching `match` from each of `fns` (wrapper and op) on real and on meta tensors."""
    for fn in fns:
        for call_args in (args, on_meta(args)):
            with pytest.raises(exc, match=match):
                fn(*call_args)


def softmax_bad_inputs(op):
    x2 = torch.randn(2, 3)
    return [
        (
            (torch.arange(3),),
            TypeError,
            rf"{op}: x must be a float32, float64, float16 or bfloat16 tensor, got torch.int64",
        ),
        ((x2, 2), IndexError, rf"{op}: dim must be in \[-2, 1\] for a 2-d x, got 2"),
        ((x2, -3), IndexError, rf"{op}: dim must be in \[-2, 1\] for a 2-d x, got -3"),
        ((torch.randn(()), -2), IndexError, rf"{op}: dim must be in \[-1, 0\] for a 0-d x, got -2"),
        (
            (torch.randn(3), 0, torch.int32),
            TypeError,
            rf"{op}: dtype must be float32, float64, float16, bfloat16 or None, got torch.int32",
        ),
        # dtype= is checked before dim, as torch converts first.
        ((torch.randn(3), 5, torch.int64), TypeError, rf"{op}: dtype must be .* got torch.int64"),
    ]


@pytest.mark.parametrize("name", OPS)
def test_bad_inputs_raise_clear_errors(name):
    fns = (OPS[name][0], getattr(torch.ops.opforge, name), getattr(torch.ops.opforge, name).default)
    for args, exc, match in softmax_bad_inputs(f"opforge.{name}"):
        raises_everywhere(fns, args, exc, match)
    # Arguments of the wrong kind: torch's binding names the argument and the expected type.
    for args, argname in (([1.0, 2.0],), "x"), ((torch.randn(3), 1.5), "dim"), ((torch.randn(3), 0, "float"), "dtype"):
        for fn in fns:
            with pytest.raises(RuntimeError, match=rf"Expected a value of type .* for argument '{argname}'"):
                fn(*args)


def test_scaled_masked_bad_inputs():
    op = "opforge.scaled_masked_softmax"
    fns = (opforge.scaled_masked_softmax, torch.ops.opforge.scaled_masked_softmax)
    x = torch.randn(2, 3, 4)
    cases = [
        ((torch.ones(2, 2, dtype=torch.int32),), TypeError, rf"{op}: x must be a float32.* got torch.int32"),
        ((torch.randn(()),), RuntimeError, rf"{op}: x must have at least 1 dimension \(\.\.\., Lk\), got a 0-d tensor"),
        (
            (x, torch.zeros(3, 5, dtype=torch.bool)),
            RuntimeError,
            rf"{op}: mask with shape \[3, 5\] is not broadcastable to x with shape \[2, 3, 4\]",
        ),
        (
            (x, torch.zeros(1, 2, 3, 4, dtype=torch.bool)),
            RuntimeError,
            r"mask with shape \[1, 2, 3, 4\] is not broadcastable",
        ),
        (
            (x, torch.zeros(4, dtype=torch.float64)),
            TypeError,
            rf"{op}: mask must be a bool tensor \(True = masked out\) "
            r"or an additive float mask of x's dtype \(torch.float32\), got torch.float64",
        ),
        ((x, torch.zeros(4, dtype=torch.int64)), TypeError, r"mask must be a bool tensor .* got torch.int64"),
    ]
    for args, exc, match in cases:
        raises_everywhere(fns, args, exc, match)
    for args, argname in (((x, [True]), "mask"), ((x, None, "1"), "scale"), ((x, None, 1.0, "yes"), "causal")):
        for fn in fns:
            with pytest.raises(RuntimeError, match=rf"Expected a value of type .* for argument '{argname}'"):
                fn(*args)
    # The schema's float takes a Python int as it is.
    torch.testing.assert_close(opforge.scaled_masked_softmax(x, None, 2), opforge.scaled_masked_softmax(x, None, 2.0))


@pytest.mark.parametrize("op", ["_softmax_backward", "_log_softmax_backward", "_scaled_masked_softmax_backward"])
def test_backward_op_bad_inputs(op):
    raw = getattr(torch.ops.opforge, op)
    name = f"opforge.{op}"
    scaled = op == "_scaled_masked_softmax_backward"
    third = 0.5 if scaled else -1
    y = torch.softmax(torch.randn(3, 4), -1)
    cases = [
        (
            (torch.randn(3, 5), y, third),
            RuntimeError,
            rf"{name}: grad and output must have the same shape, got grad \[3, 5\] and output \[3, 4\]",
        ),
        (
            (torch.randn(3, 4, dtype=torch.float64), y, third),
            TypeError,
            rf"{name}: grad and output must have the same dtype, got grad torch.float64 and output torch.float32",
        ),
        (
            (torch.ones(3, 4, dtype=torch.int32), y, third),
            TypeError,
            rf"{name}: grad must be a float32.* got torch.int32",
        ),
        ((y, y.to(torch.int64), third), TypeError, rf"{name}: output must be a float32.* got torch.int64"),
    ]
    if not scaled:
        cases.append(
            ((torch.randn(3, 4), y, 4), IndexError, rf"{name}: dim must be in \[-2, 1\] for a 2-d output, got 4")
        )
    for args, exc, match in cases:
        raises_everywhere((raw, raw.default), args, exc, match)


def test_symbolic_shapes_in_errors():
    # Under torch.compile(dynamic=True) the shape function checks symbolic
    # sizes: a mask that cannot broadcast is reported as it is seen there.
    torch._dynamo.reset()
    f = torch.compile(opforge.scaled_masked_softmax, fullgraph=True, dynamic=True)
    symbolic = r"mask with shape \[s\d+, s\d+\] is not broadcastable to x with shape \[s\d+, "
    with pytest.raises(RuntimeError, match=symbolic):
        f(torch.randn(2, 3, 4), torch.zeros(3, 5, dtype=torch.bool))


@pytest.mark.cuda
def test_mask_on_another_device_raises():
    x = torch.randn(2, 3, 4, device="cuda")
    op = "opforge.scaled_masked_softmax"
    for fn in (opforge.scaled_masked_softmax, torch.ops.opforge.scaled_masked_softmax):
        with pytest.raises(
            RuntimeError, match=rf"{op}: x and mask must be on the same device, got x on cuda:0 and mask on cpu"
        ):
            fn(x, torch.zeros(4, dtype=torch.bool))
    y = torch.softmax(x, -1)
    with pytest.raises(
        RuntimeError, match=r"grad and output must be on the same device, got grad on cpu and output on cuda:0"
    ):
        torch.ops.opforge._softmax_backward(y.cpu(), y, -1)


def test_shape_functions_match_kernels():
    # Meta results have the kernels' shape, dtype and (contiguous) strides,
    # non-contiguous inputs and dtype= included.
    x = rand((4, 6, 5)).transpose(0, 2)
    mask = torch.rand((6, 1)) < 0.3
    g = rand((5, 6, 4))
    y = torch.softmax(rand((5, 6, 4)), 1).transpose(0, 2)
    calls = [
        (torch.ops.opforge.softmax, (x, 1, None)),
        (torch.ops.opforge.softmax, (x, 0, torch.float64)),
        (torch.ops.opforge.log_softmax, (x.half(), -1, torch.float32)),
        (torch.ops.opforge.scaled_masked_softmax, (x, mask, 0.5, True)),
        (torch.ops.opforge._softmax_backward, (g.transpose(0, 2), y, 1)),
        (torch.ops.opforge._log_softmax_backward, (g.transpose(0, 2), y, 0)),
        (torch.ops.opforge._scaled_masked_softmax_backward, (g.transpose(0, 2), y, 0.5)),
    ]
    for op, args in calls:
        real, meta = op(*args), op(*on_meta(args))
        assert meta.device.type == "meta" and real.is_contiguous()
        assert (meta.shape, meta.dtype, meta.stride()) == (real.shape, real.dtype, real.stride()), op
