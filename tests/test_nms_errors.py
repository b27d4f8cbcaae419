"""The NMS family's refusals: a clear exception naming the argument, eager, under fake tensors and compile."""

import re

import pytest
import torch
from nms_check import rand_boxes, rand_scores

import opforge


def _args(device="cpu"):
    return rand_boxes(5, device=device), rand_scores(5, device=device)


_NAN = float("nan")


_LONG = torch.int64


# (op, arguments from (boxes, scores), keywords, exception, message). Shapes
# that do not fit are RuntimeError (as in torchvision), dtypes TypeError,
# unsupported option values ValueError.
_BAD = [
    ("nms", lambda b, s: (b[:, :3], s, 0.5), {}, RuntimeError, "opforge.nms: boxes must have shape (N, 4), got [5, 3]"),
    (
        "nms",
        lambda b, s: (b[None], s, 0.5),
        {},
        RuntimeError,
        "opforge.nms: boxes must have shape (N, 4), got [1, 5, 4]",
    ),
    ("nms", lambda b, s: (b[0], s, 0.5), {}, RuntimeError, "opforge.nms: boxes must have shape (N, 4), got [4]"),
    ("nms", lambda b, s: (b, s[None], 0.5), {}, RuntimeError, "opforge.nms: scores must have shape (N,), got [1, 5]"),
    (
        "nms",
        lambda b, s: (b, s[:4], 0.5),
        {},
        RuntimeError,
        "opforge.nms: boxes and scores must have the same length, got boxes with 5 and scores with 4",
    ),
    (
        "nms",
        lambda b, s: (b.long(), s, 0.5),
        {},
        TypeError,
        "opforge.nms: boxes must be a float32, float64, float16 or bfloat16 tensor, got torch.int64",
    ),
    (
        "nms",
        lambda b, s: (b, s.int(), 0.5),
        {},
        TypeError,
        "opforge.nms: scores must be a float32, float64, float16 or bfloat16 tensor, got torch.int32",
    ),
    (
        "nms",
        lambda b, s: (b, s, 0.5),
        {"score_threshold": _NAN},
        ValueError,
        "opforge.nms: score_threshold must not be NaN",
    ),
    ("nms", lambda b, s: (b, s, 0.5), {"max_output": -1}, ValueError, "opforge.nms: max_output must be >= 0, got -1"),
    (
        "batched_nms",
        lambda b, s: (b, s, torch.zeros(5), 0.5),
        {},
        TypeError,
        "opforge.batched_nms: idxs must be an int64 or int32 tensor, got torch.float32",
    ),
    (
        "batched_nms",
        lambda b, s: (b, s, torch.zeros(4, dtype=_LONG), 0.5),
        {},
        RuntimeError,
        "opforge.batched_nms: boxes and idxs must have the same length, got boxes with 5 and idxs with 4",
    ),
    (
        "batched_nms",
        lambda b, s: (b, s, torch.zeros(5, 1, dtype=_LONG), 0.5),
        {},
        RuntimeError,
        "opforge.batched_nms: idxs must have shape (N,), got [5, 1]",
    ),
    (
        "batched_nms",
        lambda b, s: (b[:, :2], s, torch.zeros(5, dtype=_LONG), 0.5),
        {},
        RuntimeError,
        "opforge.batched_nms: boxes must have shape (N, 4), got [5, 2]",
    ),
    (
        "batched_nms",
        lambda b, s: (b, s, torch.zeros(5, dtype=_LONG), 0.5),
        {"max_output": -2},
        ValueError,
        "opforge.batched_nms: max_output must be >= 0, got -2",
    ),
    ("nms_padded", lambda b, s: (b, s, 0.5, -3), {}, ValueError, "opforge.nms_padded: max_output must be >= 0, got -3"),
    (
        "nms_padded",
        lambda b, s: (b, s[:3], 0.5, 4),
        {},
        RuntimeError,
        "opforge.nms_padded: boxes and scores must have the same length, got boxes with 5 and scores with 3",
    ),
    (
        "nms_padded",
        lambda b, s: (b, s, 0.5, 4),
        {"idxs": torch.zeros(6, dtype=torch.int32)},
        RuntimeError,
        "opforge.nms_padded: boxes and idxs must have the same length, got boxes with 5 and idxs with 6",
    ),
    (
        "nms_padded",
        lambda b, s: (b, s, 0.5, 4),
        {"idxs": torch.zeros(5, dtype=torch.bool)},
        TypeError,
        "opforge.nms_padded: idxs must be an int64 or int32 tensor, got torch.bool",
    ),
    (
        "nms_padded",
        lambda b, s: (b, s, 0.5, 4),
        {"score_threshold": _NAN},
        ValueError,
        "opforge.nms_padded: score_threshold must not be NaN",
    ),
]


@pytest.mark.parametrize("name,args,kwargs,exc,text", _BAD)
def test_errors(name, args, kwargs, exc, text):
    # one contract, in C++: the wrapper and the op say the same thing
    b, s = _args()
    messages = []
    for fn in (getattr(opforge, name), getattr(torch.ops.opforge, name)):
        with pytest.raises(exc) as info:
            fn(*args(b, s), **kwargs)
        messages.append(str(info.value))
    assert text in messages[0]
    assert messages[0] == messages[1]


@pytest.mark.parametrize("name,args,kwargs,exc,text", _BAD)
def test_errors_under_fake_tensors(name, args, kwargs, exc, text):
    # the shape functions (nms_padded's Meta kernel, the others' fake kernels)
    # run the same C++ checks, on fake tensors with symbolic sizes too
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    b, s = _args()
    real = args(b, s)
    mode = FakeTensorMode(shape_env=ShapeEnv())
    fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in real]
    fake_kwargs = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    with mode, pytest.raises(exc) as info:
        getattr(torch.ops.opforge, name)(*fake, **fake_kwargs)
    # a size may be printed as its symbol
    pattern = re.sub(r"\d+", lambda m: rf"(?:{m.group()}|s\d+)", re.escape(text))
    assert re.search(pattern, str(info.value)), (str(info.value), text)


def test_errors_under_compile():
    # symbolic lengths: the message names the symbols (s0, s1 ...)
    b, s = _args()
    cases = [
        (lambda b, s: opforge.nms(b, s[:4], 0.5), "opforge.nms: boxes and scores must have the same length"),
        (
            lambda b, s: opforge.batched_nms(b, s, torch.zeros(4, dtype=_LONG), 0.5),
            "opforge.batched_nms: boxes and idxs must have the same length",
        ),
        (lambda b, s: opforge.nms(b, s, 0.5, max_output=-1), "opforge.nms: max_output must be >= 0, got -1"),
        (lambda b, s: opforge.nms_padded(b[:, :3], s, 0.5, 8), "opforge.nms_padded: boxes must have shape (N, 4)"),
        (lambda b, s: opforge.batched_nms(b, s, s, 0.5), "opforge.batched_nms: idxs must be an int64 or int32 tensor"),
    ]
    for fn, text in cases:
        torch._dynamo.reset()
        compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend="eager")
        with pytest.raises(RuntimeError, match=re.escape(text)):
            compiled(b, s)


@pytest.mark.parametrize(
    "call,text",
    [
        (lambda b, s: opforge.nms(b, s, "0.5"), "argument 'iou_threshold'"),
        (lambda b, s: opforge.nms(b, s, None), "argument 'iou_threshold'"),
        (lambda b, s: opforge.nms(b.tolist(), s, 0.5), "argument 'boxes'"),
        (lambda b, s: opforge.nms(b, s, 0.5, max_output=2.0), "argument 'max_output'"),
        (lambda b, s: opforge.nms(b, s, 0.5, score_threshold="0"), "argument 'score_threshold'"),
        (lambda b, s: opforge.batched_nms(b, s, [0] * 5, 0.5), "argument 'idxs'"),
        (lambda b, s: opforge.nms_padded(b, s, 0.5, None), "argument 'max_output'"),
        (lambda b, s: opforge.nms_padded(b, s, 0.5, 4, idxs=[0] * 5), "argument 'idxs'"),
    ],
)
def test_wrong_python_types(call, text):
    # the schema's types are checked by torch's binding (RuntimeError, as
    # for torchvision.ops.nms), before any opforge code
    b, s = _args()
    with pytest.raises(RuntimeError, match=re.escape(text)):
        call(b, s)


def test_nms_padded_max_output_too_large(device):
    """The padded output has max_output entries: past 2**31 - 1 the kernel and
    the shape function refuse it by name, before any allocation."""
    b, s = _args(device)
    text = (
        r"opforge.nms_padded: max_output must be at most 2147483647 \(the length of the padded output\), "
        r"got 1000000000000000"
    )
    for call in (opforge.nms_padded, torch.ops.opforge.nms_padded):
        with pytest.raises(ValueError, match=text):
            call(b, s, 0.5, 10**15)
    with pytest.raises(ValueError, match=r"max_output must be at most 2147483647"):
        torch.ops.opforge.nms_padded(b, s, 0.5, 2**31)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fb, fs = mode.from_tensor(b), mode.from_tensor(s)
        with pytest.raises(ValueError, match=text):
            torch.ops.opforge.nms_padded(fb, fs, 0.5, 10**15)
    padded, count = opforge.nms_padded(b, s, 0.5, 7)  # below the bound: as before
    assert padded.shape == (7,) and int(count) <= 5 and (padded[int(count) :] == -1).all()


@pytest.mark.cuda
def test_different_devices():
    # RuntimeError, as torchvision (and torch) raise for tensors on two devices
    b, s = _args()
    for fn in (opforge.nms, torch.ops.opforge.nms):
        with pytest.raises(RuntimeError, match="opforge.nms: boxes and scores must be on the same device"):
            fn(b, s.cuda(), 0.5)
    for fn in (opforge.batched_nms, torch.ops.opforge.batched_nms):
        with pytest.raises(RuntimeError, match="opforge.batched_nms: boxes and idxs must be on the same device"):
            fn(b.cuda(), s.cuda(), torch.zeros(5, dtype=torch.long), 0.5)
    with pytest.raises(RuntimeError, match="opforge.nms_padded: boxes and scores must be on the same device"):
        opforge.nms_padded(b.cuda(), s, 0.5, 4)
