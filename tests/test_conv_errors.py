"""opforge.conv2d_3x3's refusals: bad arguments raise a clear exception naming the argument,
the same through the wrapper and the raw op."""

import pytest
import torch
from reference import rand

import opforge


def _args(device="cpu"):
    return rand((2, 4, 8, 8), torch.float32, device), rand((6, 4, 3, 3), torch.float32, device)


CALLS = {"wrapper": opforge.conv2d_3x3, "raw": torch.ops.opforge.conv2d_3x3}


# Exception types as F.conv2d raises them for what it refuses too
# (RuntimeError for shapes that do not fit), ValueError for values opforge
# does not support, TypeError for dtypes; the same message through the
# wrapper and the op.
@pytest.mark.parametrize("fn", ["wrapper", "raw"])
def test_errors(fn):
    def call(x, w, b=None, stride=1, padding=0, groups=1, activation=None):
        return CALLS[fn](x, w, b, stride, padding, groups, activation)

    x, w = _args()
    with pytest.raises(RuntimeError, match=r"x must be a 3-d \(C, H, W\) or 4-d \(N, C, H, W\) tensor, got 2-d"):
        call(x[0, 0], w)
    with pytest.raises(RuntimeError, match=r"x must be a 3-d .* got 5-d with shape \[1, 2, 4, 8, 8\]"):
        call(x[None], w)
    with pytest.raises(RuntimeError, match=r"weight must be a 4-d tensor, got 2-d"):
        call(x, w[:, :, 0, 0])
    with pytest.raises(ValueError, match=r"weight must have a 3x3 kernel .* got shape \[6, 4, 5, 5\]"):
        call(x, rand((6, 4, 5, 5)))
    with pytest.raises(
        RuntimeError, match=r"weight must have C/groups = 4 input channels .* got weight shape \[6, 3, 3, 3\]"
    ):
        call(x, rand((6, 3, 3, 3)))
    with pytest.raises(ValueError, match=r"groups must be 1 or the number of input channels \(4\), got 2"):
        call(x, rand((6, 2, 3, 3)), groups=2)
    with pytest.raises(RuntimeError, match=r"output channels \(6\) must be a positive multiple of groups \(4\)"):
        call(x, rand((6, 1, 3, 3)), groups=4)
    with pytest.raises(RuntimeError, match=r"output channels \(0\) must be a positive multiple of groups \(1\)"):
        call(x, rand((0, 4, 3, 3)))
    with pytest.raises(ValueError, match=r"stride must be 1 or 2, got 3"):
        call(x, w, stride=3)
    with pytest.raises(ValueError, match=r"stride must be 1 or 2, got 0"):
        call(x, w, stride=(0, 0))
    with pytest.raises(ValueError, match=r"padding must be 0 or 1, got 2"):
        call(x, w, padding=2)
    with pytest.raises(ValueError, match=r"stride must be an int or a pair of equal ints .* got \[1, 2\]"):
        call(x, w, stride=(1, 2))
    with pytest.raises(ValueError, match=r"stride must be an int or a pair of equal ints .* got \[1, 1, 1\]"):
        call(x, w, stride=[1, 1, 1])
    with pytest.raises(ValueError, match=r"padding must be an int or a pair of equal ints .* got \[0, 1\]"):
        call(x, w, padding=(0, 1))
    with pytest.raises(ValueError, match=r"padding must be 'same', 'valid', 0 or 1, got 'full'"):
        call(x, w, padding="full")
    with pytest.raises(ValueError, match=r"padding='same' is not supported for strided convolutions .* stride 2"):
        call(x, w, stride=2, padding="same")
    with pytest.raises(ValueError, match=r"stride must be an int or a pair of equal ints .* got \[2, 1\]"):
        call(x, w, stride=(2, 1), padding="same")
    with pytest.raises(
        ValueError, match=r"activation must be None, 'relu', 'relu6', 'hardswish' or 'silu', got 'gelu'"
    ):
        call(x, w, activation="gelu")
    with pytest.raises(
        ValueError, match=r"activation must be None, 'relu', 'relu6', 'hardswish' or 'silu', got 'gelu'"
    ):
        call(x, w, padding="same", activation="gelu")
    with pytest.raises(
        TypeError, match=r"x and weight must have the same dtype, got x torch.float32 and weight torch.float64"
    ):
        call(x, w.double())
    with pytest.raises(TypeError, match=r"x must be a float32, float64, float16 or bfloat16 tensor, got torch.int32"):
        call(x.int(), w)
    with pytest.raises(RuntimeError, match=r"bias must have shape \[6\], got \[5\]"):
        call(x, w, rand((5,)))
    with pytest.raises(RuntimeError, match=r"bias must have shape \[6\], got \[6, 1\]"):
        call(x, w, rand((6, 1)))
    with pytest.raises(TypeError, match=r"bias must have x's dtype torch.float32, got torch.float64"):
        call(x, w, rand((6,), torch.float64))
    with pytest.raises(RuntimeError, match=r"spatial size \(2, 8\) with padding 0 is smaller than the 3x3 kernel"):
        call(x[:, :, :2], w)
    with pytest.raises(RuntimeError, match=r"spatial size \(2, 8\) with padding 0 is smaller than the 3x3 kernel"):
        call(x[0, :, :2], w, padding="valid")


def test_errors_are_the_same_message():
    """The wrapper adds nothing: its message is the op's, word for word."""
    x, w = _args()
    messages = []
    for call in CALLS.values():
        with pytest.raises(RuntimeError) as info:
            call(x, rand((6, 3, 3, 3)))
        messages.append(str(info.value).splitlines()[0])
    assert messages[0] == messages[1]
    assert messages[0].startswith("opforge.conv2d_3x3: weight must have C/groups = 4 input channels")


def test_binding_errors_name_the_argument():
    """Arguments of the wrong Python type get torch's binding error, which
    names the argument and the type the schema expects."""
    x, w = _args()
    for call in CALLS.values():
        with pytest.raises(RuntimeError, match=r"weight"):
            call(x, [1.0])
        with pytest.raises(RuntimeError, match=r"stride"):
            call(x, w, None, 1.5)
        with pytest.raises(RuntimeError, match=r"activation"):
            call(x, w, None, 1, 0, 1, True)


@pytest.mark.cuda
def test_different_devices_raise():
    x, w = _args()
    for call in CALLS.values():
        with pytest.raises(
            RuntimeError, match=r"x and weight must be on the same device, got x on cpu and weight on cuda:0"
        ):
            call(x, w.cuda())
        with pytest.raises(RuntimeError, match=r"x and bias must be on the same device"):
            call(x.cuda(), w.cuda(), rand((6,)))
        with pytest.raises(RuntimeError, match=r"x and weight must be on the same device"):
            call(x.cuda(), w, None, 1, 0, 1, None)


def test_backward_op_errors():
    x, w = _args()
    g = rand((2, 6, 6, 6))
    bwd = torch.ops.opforge._conv2d_3x3_backward
    with pytest.raises(RuntimeError, match=r"grad_out must have shape \[2, 6, 6, 6\], got \[2, 6, 6, 5\]"):
        bwd(g[..., :5], None, x, w, 1, 0, 1, [True, True, True])
    with pytest.raises(RuntimeError, match=r"grad_out must have shape \[6, 6, 6\], got \[2, 6, 6, 6\]"):
        bwd(g, None, x[0], w, 1, 0, 1, [True, True, True])
    with pytest.raises(RuntimeError, match=r"result must have grad_out's shape"):
        bwd(g, g[..., :5], x, w, 1, 0, 1, [True, True, True])
    with pytest.raises(TypeError, match=r"grad_out must have x's dtype"):
        bwd(g.double(), None, x, w, 1, 0, 1, [True, True, True])
    with pytest.raises(ValueError, match=r"_conv2d_3x3_backward: stride must be 1 or 2, got 3"):
        bwd(g, None, x, w, 3, 0, 1, [True, True, True])
