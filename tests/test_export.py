"""torch.export of every public op: strict and non-strict, dynamic batch, save/load in a fresh process."""

import subprocess
import sys
import textwrap

import pytest
import torch
from reference import rand
from torch.export import Dim

import opforge


class Ops(torch.nn.Module):
    """One module per op, called as a model would call it."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def _boxes(n):
    xy = torch.rand(n, 2) * 64
    return torch.cat([xy, xy + torch.rand(n, 2) * 24 + 4], 1), torch.rand(n)


# name -> (inputs for a batch size n, call, whether the batch size is dynamic in the export)
CASES = {
    "add": (lambda n: (rand((n, 33)), rand((33,))), lambda a, b: opforge.add(a, b), True),
    "add_relu": (lambda n: (rand((n, 33)), rand((n, 33))), lambda a, b: opforge.add_relu(a, b), True),
    "add_relu number": (lambda n: (rand((n, 33)),), lambda a: opforge.add_relu(a, 0.5), True),
    "softmax": (lambda n: (rand((n, 40)),), lambda x: opforge.softmax(x, -1), True),
    "log_softmax": (lambda n: (rand((n, 40)),), lambda x: opforge.log_softmax(x, -1), True),
    "scaled_masked_softmax": (
        lambda n: (rand((n, 4, 16, 16)), torch.rand(16, 16) > 0.5),
        lambda x, m: opforge.scaled_masked_softmax(x, m, 0.125),
        True,
    ),
    "conv2d_3x3": (
        lambda n: (rand((n, 8, 12, 12)), rand((16, 8, 3, 3)), rand((16,))),
        lambda x, w, b: opforge.conv2d_3x3(x, w, b, 1, 1, activation="relu"),
        True,
    ),
    "conv2d_3x3 depthwise": (
        lambda n: (rand((n, 8, 12, 12)), rand((8, 1, 3, 3)), rand((8,))),
        lambda x, w, b: opforge.conv2d_3x3(x, w, b, 2, 1, 8),
        True,
    ),
    "nms": (lambda n: _boxes(50 * n), lambda b, s: opforge.nms(b, s, 0.5), True),
    "batched_nms": (
        lambda n: (*_boxes(50 * n), torch.randint(0, 5, (50 * n,))),
        lambda b, s, i: opforge.batched_nms(b, s, i, 0.5),
        True,
    ),
    "nms_padded": (lambda n: _boxes(50 * n), lambda b, s: opforge.nms_padded(b, s, 0.5, 100), False),
}


def _dynamic_shapes(inputs, dynamic):
    """Dim 0 of the first input varies, and with it every input of the same length (boxes, scores, idxs)."""
    if not dynamic:
        return None
    batch = Dim("batch", min=2, max=1 << 20)
    n = inputs[0].shape[0]
    # forward(*args): the shapes are given for the one varargs parameter.
    return {"args": tuple({0: batch} if t.dim() > 0 and t.shape[0] == n else None for t in inputs)}


def _check(out, expected):
    outs = out if isinstance(out, tuple) else (out,)
    exps = expected if isinstance(expected, tuple) else (expected,)
    for o, e in zip(outs, exps, strict=True):
        torch.testing.assert_close(o, e)


@pytest.mark.parametrize("strict", [False, True], ids=["non-strict", "strict"])
@pytest.mark.parametrize("name", CASES)
def test_export_and_run(name, strict):
    make, call, dynamic = CASES[name]
    inputs = make(6)
    model = Ops(call)
    ep = torch.export.export(model, inputs, dynamic_shapes=_dynamic_shapes(inputs, dynamic), strict=strict)
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert any(t.startswith("opforge.") for t in targets), targets
    _check(ep.module()(*inputs), model(*inputs))
    if dynamic:  # another batch size through the same program
        other = make(9)
        _check(ep.module()(*other), model(*other))


def test_save_and_load_in_a_fresh_process(tmp_path):
    # Every op in one program, saved, then loaded and run by a new interpreter that imports opforge.
    inputs = {name: CASES[name][0](6) for name in CASES}
    expected = {name: Ops(CASES[name][1])(*inputs[name]) for name in CASES}
    for name in CASES:
        ep = torch.export.export(Ops(CASES[name][1]), inputs[name])
        torch.export.save(ep, tmp_path / f"{name}.pt2")
    torch.save({"inputs": inputs, "expected": expected}, tmp_path / "data.pt")
    code = textwrap.dedent(
        f"""
        import torch, opforge
        data = torch.load({str(tmp_path / "data.pt")!r})
        for name, args in data["inputs"].items():
            out = torch.export.load({str(tmp_path)!r} + "/" + name + ".pt2").module()(*args)
            exp = data["expected"][name]
            outs, exps = (out, exp) if isinstance(out, tuple) else ((out,), (exp,))
            for o, e in zip(outs, exps):
                torch.testing.assert_close(o, e)
        print("loaded", len(data["inputs"]))
        """
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"loaded {len(CASES)}" in run.stdout
