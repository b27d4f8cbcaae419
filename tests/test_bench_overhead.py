"""Tests of `opforge bench overhead`: its cases, method, reports and command (tiny repeat counts)."""

import json

import pytest
import torch

from opforge import cli
from opforge.bench import overhead, overhead_cases, overhead_report

TINY = dict(calls=2, repeats=3)


def test_every_op_appears_with_and_without_grad(device):
    run = overhead.run(overhead.Settings(device=device, **TINY), progress=False)
    ops = [c.op for c in overhead_cases.cases()]
    assert [(r.op, r.grad) for r in run.rows] == [(op, g) for op in ops for g in (False, True)]
    public = {
        "add",
        "add_relu",
        "softmax",
        "log_softmax",
        "scaled_masked_softmax",
        "nms",
        "batched_nms",
        "nms_padded",
        "conv2d_3x3 dense",
        "conv2d_3x3 dense relu",
        "conv2d_3x3 depthwise",
        "conv2d_3x3 depthwise relu",
    }
    assert set(ops) == public
    for r in run.rows:
        assert r.status == "ok", (r.op, r.detail)
        for key in ("opforge", "floor_wrapper", "floor_direct"):
            t = r.providers[key]
            assert 0 < t.p20_us <= t.median_us <= t.p80_us
        if r.providers["torch"] is not None:  # absent only for nms without torchvision
            assert r.ratio == r.providers["opforge"].median_us / r.providers["torch"].median_us
    assert run.environment["device"] == device


def test_with_grad_rows_give_the_ops_inputs_that_require_grad():
    case = next(c for c in overhead_cases.cases() if c.op == "conv2d_3x3 depthwise relu")
    seen = []
    case.ours = lambda *a: seen.append([t.requires_grad for t in a]) or case.torch_fn(*a)
    for grad in (False, True):
        overhead.time_row(case, grad, overhead.Settings(**TINY))
    assert seen[0] == [False] * 3 and seen[-1] == [True] * 3


def test_floor_op_exists_and_returns_an_empty_tensor(device):
    noop = overhead.noop_op()
    assert str(noop.default._schema) == "opforge_bench::noop(Tensor x) -> Tensor"
    wrapper = overhead.make_noop_wrapper()
    for x in (torch.randn(16, device=device), torch.randn(16, device=device, dtype=torch.float64, requires_grad=True)):
        for out in (noop(x), noop.default(x), wrapper(x)):
            assert out.numel() == 0 and out.shape == (0,)
            assert out.dtype == x.dtype and out.device == x.device


def test_ratio_is_opforge_over_torch_from_the_medians():
    row = overhead.Row(
        op="add",
        shape="16",
        grad=False,
        torch_name="torch.add",
        status="ok",
        providers={
            "opforge": overhead.Timed(3.0, 2.9, 3.1),
            "torch": overhead.Timed(1.5, 1.4, 1.6),
            "floor_wrapper": overhead.Timed(2.0, 2.0, 2.0),
            "floor_direct": None,
        },
    )
    assert row.ratio == 2.0
    run = overhead.Run(overhead.Settings(), {"cpu_cores": 2, "usable_cores": 2}, [row])
    assert overhead_report.rows(run)[0][3:8] == ["3.00", "1.50", "2.00", "2.00", "-"]
    assert overhead_report.to_json(run)["results"][0]["ratio_opforge_over_torch"] == 2.0
    row.providers["torch"] = None
    assert row.ratio is None and overhead_report.rows(run)[0][5] == "-"


def test_a_sample_is_one_loop_over_its_calls_with_the_device_idle_at_both_ends():
    events = []
    per_call = overhead.loop_seconds(lambda: events.append("call"), [], 4, lambda: events.append("sync"))
    assert events == ["sync"] + ["call"] * 4 + ["sync"] and per_call >= 0
    t = overhead.summarise([3e-6, 1e-6, 2e-6, 100e-6, 2e-6])
    assert t.median_us == pytest.approx(2.0) and t.p20_us <= 2.0 <= t.p80_us


def test_wrong_result_is_reported_and_not_timed():
    case = overhead_cases.OverheadCase(
        op="wrong",
        label="16",
        make_inputs=lambda d: [torch.randn(16)],
        grad_inputs=(0,),
        ours=lambda x: x * 2,
        torch_fn=lambda x: x * 3,
        torch_name="x * 3",
    )
    row = overhead.time_row(case, False, overhead.Settings(**TINY))
    assert row.status == "WRONG" and row.detail and all(t is None for t in row.providers.values())
    assert overhead_report.rows(overhead.Run(overhead.Settings(), {}, [row]))[0][3] == "WRONG"


@pytest.mark.parametrize("load, spread, warned", [(1.0, 1.1, False), (3.5, 1.1, True), (1.0, 2.0, True)])
def test_busy_warning_follows_the_harness_rule(load, spread, warned):
    row = overhead.Row(
        op="add",
        shape="16",
        grad=True,
        torch_name="torch.add",
        status="ok",
        providers={
            "opforge": overhead.Timed(2.0, 1.0, spread),
            "torch": None,
            "floor_wrapper": None,
            "floor_direct": None,
        },
    )
    env = {"usable_cores": 2, "load_avg_1m_start": load, "load_avg_1m": 1.0}
    warning = overhead_report.busy_warning(overhead.Run(overhead.Settings(), env, [row]))
    assert (warning is not None) == warned
    if warned:
        assert ("busy machine" in warning) == (load > 2) and ("unsteady" in warning) == (spread > 1.5)


def test_command_writes_json_and_markdown_and_redraws_them(tmp_path, capsys):
    saved, md = tmp_path / "o.json", tmp_path / "o.md"
    args = ["bench", "overhead", "add", "nms", "--device", "cpu", "--calls", "2", "--repeats", "2", "--no-progress"]
    assert cli.main(args + ["--json", str(saved), "--markdown", str(md)]) == 0
    data = json.loads(saved.read_text())
    assert data["schema"] == overhead_report.SCHEMA and data["settings"]["calls"] == 2
    assert {r["op"] for r in data["results"]} == {"add", "add_relu", "nms", "nms_padded"}  # names start with OPS
    assert "| add_relu | 16 | yes |" in md.read_text()
    table = capsys.readouterr().out
    assert "floor wrapper us" in table and "opforge / torch" in table
    assert cli.main(["bench", "overhead", "--from-json", str(saved)]) == 0
    assert "torch.relu(a + b)" in capsys.readouterr().out


@pytest.mark.parametrize("extra", [["no_such_op"], ["--mode", "fwd"], ["--dtype", "bf16"]])
def test_command_refuses_what_does_not_apply(extra):
    assert cli.main(["bench", "overhead", *extra, "--device", "cpu"]) == 2


def test_quick_uses_fewer_calls(monkeypatch):
    seen = {}

    def fake_run(settings, progress, only):
        seen["s"] = settings
        return overhead.Run(settings, {}, [])

    monkeypatch.setattr(overhead, "run", fake_run)
    monkeypatch.setattr(overhead_report, "table", lambda run: "")
    assert cli.main(["bench", "overhead", "--device", "cpu", "--quick"]) == 0
    assert (seen["s"].calls, seen["s"].repeats) == (overhead.QUICK_CALLS, overhead.QUICK_REPEATS)
