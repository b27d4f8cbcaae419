"""Drop-in checks against PyTorch's own OpInfo samples: every sample of the torch op that
opforge replaces either gives torch's result or is refused with opforge's clear error.

What is refused is what each op's page lists (add: ``alpha``; conv2d_3x3: kernels
other than 3x3, dilation, groups other than 1 or C, unequal or other strides and
paddings).
"""

import pytest
import torch
import torch.nn.functional as F

import opforge

op_db = pytest.importorskip("torch.testing._internal.common_methods_invocations").op_db


def _samples(name: str, device: str, dtype: torch.dtype):
    (info,) = [o for o in op_db if o.name == name and o.variant_test_name == ""]
    return list(info.sample_inputs(device, dtype, requires_grad=False))


def _close(out, expected, dtype):
    tol = {torch.float64: 1e-12, torch.float32: 1e-5}[dtype]
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_add_samples(dtype, device):
    checked = 0
    for s in _samples("add", device, dtype):
        if "alpha" in s.kwargs or s.kwargs:
            with pytest.raises(TypeError, match="alpha"):
                opforge.add(s.input, *s.args, **s.kwargs)
            continue
        other = s.args[0]
        expected = torch.add(s.input, other)
        if expected.dtype != dtype:  # an int or complex other widens torch's result: not opforge's dtypes
            continue
        _close(opforge.add(s.input, other), expected, dtype)
        _close(opforge.add_relu(s.input, other), torch.relu(expected), dtype)
        checked += 1
    assert checked > 5


@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_softmax_samples(name, dtype, device):
    ours, theirs = getattr(opforge, name), getattr(torch, name)
    samples = _samples(name, device, dtype)
    for s in samples:
        _close(ours(s.input, *s.args, **s.kwargs), theirs(s.input, *s.args, **s.kwargs), dtype)
    assert len(samples) > 3


def _pair(v):
    return tuple(v) if isinstance(v, (tuple, list)) else (v, v)


def _supported(x, w, kwargs) -> bool:
    """Whether opforge's conv2d_3x3 takes this F.conv2d call (its page's list)."""
    groups = kwargs.get("groups", 1)
    stride, padding = _pair(kwargs.get("stride", 1)), kwargs.get("padding", 0)
    channels = x.shape[-3]
    ok = tuple(w.shape[2:]) == (3, 3) and _pair(kwargs.get("dilation", 1)) == (1, 1)
    ok = ok and (groups == 1 or groups == channels) and stride[0] == stride[1] and stride[0] in (1, 2)
    if isinstance(padding, str):
        return ok and (padding == "valid" or stride[0] == 1)
    padding = _pair(padding)
    return ok and padding[0] == padding[1] and padding[0] in (0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_conv2d_samples(dtype, device):
    matched = refused = 0
    for s in _samples("nn.functional.conv2d", device, dtype):
        x, (w, *rest) = s.input, s.args
        bias = rest[0] if rest else None
        kwargs = dict(s.kwargs)
        args = dict(stride=kwargs.get("stride", 1), padding=kwargs.get("padding", 0), groups=kwargs.get("groups", 1))
        if _supported(x, w, kwargs):
            _close(opforge.conv2d_3x3(x, w, bias, **args), F.conv2d(x, w, bias, **kwargs), dtype)
            matched += 1
        elif "dilation" in kwargs and _pair(kwargs["dilation"]) != (1, 1):
            continue  # opforge's conv2d_3x3 has no dilation argument at all
        else:
            with pytest.raises((ValueError, RuntimeError), match=r"^opforge\.conv2d_3x3: "):
                opforge.conv2d_3x3(x, w, bias, **args)
            refused += 1
    assert matched >= 6 and refused >= 3, (matched, refused)
