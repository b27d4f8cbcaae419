"""Tests of the benchmark harness, its reports and `opforge info` (CPU, small)."""

import dataclasses
import io
import json

import pytest
import torch

from opforge import cli, info
from opforge.bench import harness, machine, noise, registry, report


def _tiny(x):
    return x * 2 + 1


class _WrongGrad(torch.autograd.Function):
    """Right forward, wrong backward (the gradient is off by a factor)."""

    @staticmethod
    def forward(ctx, x):
        return x * 2 + 1

    @staticmethod
    def backward(ctx, g):
        return g * 3


def _make(device, op, ours, eager, **kw):
    n = 4096
    return registry.BenchCase(
        op=op,
        label=f"N={n}",
        dtype=torch.float32,
        make_inputs=lambda: [torch.randn(n, device=device)],
        ours=ours,
        eager=eager,
        eager_name="tiny_eager",
        bytes_fwd=2 * n * 4,
        bytes_bwd=2 * n * 4,
        quick=True,
        **kw,
    )


@pytest.fixture
def families():
    """Test-only families, registered for one test and removed after it."""
    calls = {"wrong": 0}

    def wrong(x):
        calls["wrong"] += 1
        return x * 2  # forgets the + 1

    added = {
        "_test_tiny": lambda device: [_make(device, "tiny", lambda x: torch.add(x * 2, 1), _tiny, grad_inputs=(0,))],
        "_test_wrong": lambda device: [_make(device, "tiny_wrong", wrong, _tiny, compile=False)],
        "_test_wrong_grad": lambda device: [
            _make(device, "tiny_wrong_grad", _WrongGrad.apply, _tiny, grad_inputs=(0,), compile=False)
        ],
        "_test_nocompile": lambda device: [_make(device, "tiny_nocompile", _tiny, _tiny)],
    }
    registry._REGISTRY.update(added)
    yield calls
    for name in added:
        registry._REGISTRY.pop(name, None)


def test_tiny_run_table_json_markdown_plot(families, tmp_path, capsys):
    paths = {k: tmp_path / f"r.{k}" for k in ("json", "md", "png")}
    rc = cli.main(
        [
            "bench",
            "_test_tiny",
            "--device",
            "cpu",
            "--quick",
            "--mode",
            "fwd,bwd",
            "--mode",
            "full",
            "--json",
            str(paths["json"]),
            "--markdown",
            str(paths["md"]),
            "--plot",
            str(paths["png"]),
        ]
    )
    out = capsys.readouterr()
    assert rc == 0, out.out
    for col in (
        "op",
        "shape",
        "dtype",
        "mode",
        "opforge ms",
        "eager ms",
        "compiled ms",
        "peer ms",
        "vs eager",
        "vs compiled",
        "% floor",
    ):
        assert col in out.out
    rows = [line for line in out.out.splitlines() if line.startswith("tiny ")]
    assert [r.split()[3] for r in rows] == ["fwd", "bwd", "full"]
    assert "device copy" in out.out
    assert "% floor = floor time / opforge's time" in out.out  # the column is explained under the table
    assert "[" not in out.err and "\r" not in out.err  # no progress bar when stderr is not a terminal

    data = json.loads(paths["json"].read_text())
    assert data["schema"] == report.SCHEMA
    assert data["settings"]["timer"].startswith("torch.utils.benchmark")
    env = data["environment"]
    for key in ("device", "opforge", "git_commit", "torch", "cuda", "cpu", "cpu_isa", "gpu", "python", "date_utc"):
        assert key in env
    assert env["device"] == "cpu" and env["cpu_isa"]
    assert data["copy_bandwidth_gbps"] > 0 and data["last_level_cache_bytes"] > 0
    assert len(data["results"]) == 3
    for r in data["results"]:
        assert {"op", "shape", "dtype", "mode", "bytes", "providers", "speedup_vs_eager", "speedup_vs_compiled"} <= set(
            r
        )
        assert set(r["providers"]) == {"opforge", "eager", "compiled"}
        for p in r["providers"].values():
            assert p["status"] == "ok", p
            assert 0 < p["p20_ms"] <= p["median_ms"] <= p["p80_ms"]
            assert p["gbps"] > 0 and p["pct_floor"] > 0
            assert p["peak_mem_bytes"] is None  # not measured on the CPU
        assert r["input_sets"] > 1  # 32 KiB inputs are rotated
        assert r["speedup_vs_eager"] > 0
    assert {r["mode"]: r["bytes"] for r in data["results"]} == {"fwd": 32768, "bwd": 32768, "full": 65536}

    md = paths["md"].read_text()
    assert md.startswith("# opforge benchmark results")
    assert "| tiny | N=4096 | float32 | fwd |" in md
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_wrong_kernel_is_reported_and_not_timed(families, capsys):
    settings = harness.Settings(device="cpu", quick=True, modes=("fwd",), ops=("_test_wrong",))
    run = harness.run(settings, progress=False)
    (res,) = run.results
    ours = res.providers["opforge"]
    assert ours.status == "WRONG" and ours.median_ms is None and ours.gbps is None
    assert "Mismatched elements" in ours.detail or "output" in ours.detail
    assert families["wrong"] == 1  # called once by the check, never by a timer
    assert res.providers["eager"].status == "ok"  # the others are still timed
    assert res.speedup("eager") is None

    rc = cli.main(["bench", "_test_wrong", "--device", "cpu", "--quick", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 1
    row = next(line for line in out.splitlines() if line.startswith("tiny_wrong "))
    assert "WRONG" in row
    assert "opforge (opforge) WRONG" in out


def test_wrong_gradient_is_caught(families):
    run = harness.run(
        harness.Settings(device="cpu", quick=True, modes=("fwd", "bwd"), ops=("_test_wrong_grad",)), progress=False
    )
    status = {r.mode: r.providers["opforge"].status for r in run.results}
    assert status == {"fwd": "ok", "bwd": "WRONG"}
    assert "grad of input 0" in run.results[1].providers["opforge"].detail


def test_compile_error_is_reported_not_fatal(families, monkeypatch):
    def failing_compile(fn, **kwargs):
        def compiled(*args):
            raise RuntimeError("this composition refuses to compile")

        return compiled

    monkeypatch.setattr(torch, "compile", failing_compile)
    run = harness.run(
        harness.Settings(device="cpu", quick=True, modes=("fwd",), ops=("_test_nocompile",)), progress=False
    )
    (res,) = run.results
    assert res.providers["compiled"].status == "error"
    assert "refuses to compile" in res.providers["compiled"].detail
    assert res.providers["opforge"].status == "ok" and res.providers["eager"].status == "ok"
    assert "error" in report.table(run)


def test_unknown_op_is_an_error(capsys):
    assert cli.main(["bench", "no_such_op", "--device", "cpu", "--quick"]) == 2
    assert "unknown op no_such_op" in capsys.readouterr().out


def test_add_relu_cases_are_registered():
    fams = registry.families()
    assert "add_relu" in fams
    cases = fams["add_relu"]("cpu")
    assert any(c.quick for c in cases)
    assert all(c.bytes_fwd > 0 and c.grad_inputs for c in cases)


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_shows_on_a_terminal_and_erases_itself():
    stream = _Terminal()
    bar = harness.Progress(2, stream=stream)
    bar.step("first")
    bar.step("second")
    bar.close()
    frames = stream.getvalue().split("\r\033[K")
    assert frames[0] == "" and "\n" not in stream.getvalue()  # one line, rewritten in place
    assert frames[1].startswith("[....") and "0/2" in frames[1] and "first" in frames[1]
    assert frames[2].startswith("[####") and "1/2" in frames[2] and "second" in frames[2]
    assert frames[3] == ""  # erased at the end: only the table stays on the screen

    piped = io.StringIO()  # a pipe or a log file: no bar at all
    bar = harness.Progress(2, stream=piped)
    bar.step("first")
    bar.close()
    assert piped.getvalue() == ""


def test_last_level_cache_size():
    assert harness.last_level_cache_bytes("cpu") >= 1 << 20


def test_info(capsys):
    text = info.report()
    import opforge

    for needle in (
        "opforge      " + opforge.__version__,
        "torch        " + torch.__version__,
        "CUDA kernels",
        "CPU kernels",
        "add_relu",
        "_add_relu_backward",
        "bench cases",
        "JIT cache",
        "GPU",
    ):
        assert needle in text, needle
    from opforge import _loader

    assert f"CPU kernels  {_loader.build_info()['cpu_isa']}" in text  # the ISA the library itself picked
    assert cli.main(["info"]) == 0
    assert "CPU kernels" in capsys.readouterr().out


def test_report_memory_columns():
    """Peak-memory columns appear when memory was measured (the GPU)."""
    p = lambda name, ms, mem: harness.ProviderResult(name, "ok", ms, ms, ms, mem, 1.0, 50.0)  # noqa: E731
    res = harness.CaseResult(
        "f",
        "op",
        "N=1",
        "float32",
        "fwd",
        8,
        0.0,
        1,
        {"opforge": p("opforge", 1.0, 2 << 20), "eager": p("e", 2.0, 6 << 20), "compiled": p("c", 1.5, 4 << 20)},
    )
    run = harness.Run(
        harness.Settings(device="cuda"),
        {"gpu": "X", "opforge": "0", "torch": "0", "cuda": None, "date_utc": "-", "git_commit": None},
        100.0,
        1 << 20,
        [res],
    )
    header, rows = report.rows(run)
    assert header[-1] == "peak MiB opforge/eager/compiled" and rows[0][-1] == "2/6/4"
    assert rows[0][8] == "2.00x" and rows[0][9] == "1.50x" and rows[0][12] == "50%"
    assert header[13] == "% of copy" and rows[0][13] == "-"  # no copy timed
    res.copy_ms = 0.8  # a copy of the same bytes took 0.8 ms, opforge 1.0 ms
    assert report.rows(run)[1][0][13] == "80%" and report.to_json(run)["results"][0]["pct_copy"] == pytest.approx(80.0)


@pytest.mark.cuda
def test_tiny_run_cuda(families):
    run = harness.run(harness.Settings(device="cuda", quick=True, ops=("_test_tiny", "_test_wrong")), progress=False)
    by_op = {(r.op, r.mode): r for r in run.results}
    tiny = by_op[("tiny", "fwd")]
    for key in ("opforge", "eager", "compiled"):
        assert tiny.providers[key].status == "ok"
        assert tiny.providers[key].median_ms > 0 and tiny.providers[key].peak_mem_bytes is not None
    assert by_op[("tiny_wrong", "fwd")].providers["opforge"].status == "WRONG"
    assert tiny.bytes == 2 * 4096 * 4 and tiny.copy_ms > 0 and tiny.pct_copy > 0  # a copy of the same 32 KiB timed
    assert run.environment["gpu"] and run.copy_bandwidth_gbps > 100
    assert run.cache_bytes >= 1 << 20


def test_timing_percentiles_bracket_the_median():
    from opforge.bench.timing import Timing

    assert Timing.from_samples([0.1, 0.1]) == Timing(0.1, 0.1, 0.1)
    t = Timing.from_samples([3.0, 1.0, 2.0, 5.0, 4.0])
    assert t.median_ms == 3.0 and t.p20_ms <= 3.0 <= t.p80_ms


def test_demo_is_quick_bench(monkeypatch):
    from opforge.bench import cli_args

    seen = {}
    monkeypatch.setattr(cli_args, "run_bench", lambda args: seen.setdefault("args", args) and 0)
    assert cli.build_parser().parse_args(["demo"]).func is cli_args.run_demo
    cli.main(["demo", "--device", "cpu"])
    args = seen["args"]
    assert args.quick and args.device == "cpu" and args.ops == [] and args.mode is None


def test_broken_family_is_reported_not_fatal(families):
    def broken(device):
        raise ImportError("peer library missing")

    registry._REGISTRY["_test_broken"] = broken
    try:
        run = harness.run(
            harness.Settings(device="cpu", quick=True, ops=("_test_broken", "_test_wrong")), progress=False
        )
    finally:
        registry._REGISTRY.pop("_test_broken")
    assert [r.op for r in run.results] == ["tiny_wrong"]
    assert run.problems == ["_test_broken: cases could not be built: ImportError: peer library missing"]
    assert "peer library missing" in report.table(run)
    assert report.to_json(run)["problems"] == run.problems


def test_a_run_records_the_load_at_its_start_and_end(families, monkeypatch):
    monkeypatch.setattr(harness, "load_average", lambda: 5.0)  # a build was running when it began
    monkeypatch.setattr(machine, "load_average", lambda: 0.5)
    monkeypatch.setattr(machine, "usable_cores", lambda: 2)
    run = harness.run(harness.Settings(device="cpu", quick=True, modes=("fwd",), ops=("_test_tiny",)), progress=False)
    env = run.environment
    assert env["load_avg_1m_start"] == 5.0 and env["load_avg_1m"] == 0.5 and env["usable_cores"] == 2
    assert "load average 5.0 at the start of the run" in noise.busy_warning(run)
    saved = report.from_json(report.to_json(run))
    assert noise.busy_warning(saved) == noise.busy_warning(run)  # --from-json warns alike


def test_softmax_plan_candidates():
    """The plan sweep's candidates follow the kernels' limits (no GPU needed to list them)."""
    from opforge.bench import softmax_plans

    assert softmax_plans.max_vectors(torch.float32, 1) == 16 and softmax_plans.max_vectors(torch.float32, 2) == 8
    # 2-byte values are held packed, two per register: twice the vectors of widened values
    assert softmax_plans.max_vectors(torch.bfloat16, 1) == 16 and softmax_plans.max_vectors(torch.bfloat16, 2) == 8
    fwd = softmax_plans.candidates(32768, torch.float32, 1)
    assert (512, 1, 16, False, False) in fwd  # one block holds the row: 512 threads x 64 values
    assert (256, 1, 16, True, False) in fwd  # a cluster of two
    assert (512, 1, 16, True, True) in fwd and (256, 1, 8, True, True) in fwd  # resident: a block, clusters of 4
    assert all(len(p) == 5 for p in fwd)
    assert not any(p[4] for p in softmax_plans.candidates(262144, torch.bfloat16, 1))  # built for 4-byte types
    bwd = softmax_plans.candidates(40000, torch.bfloat16, 2)
    assert (512, 1, 8, True, False) in bwd and (512, 1, 4, False, False) in bwd  # a cluster of 2, a split of 3
    assert not any(p[4] for p in bwd)
    # both arrays held: up to 8 vectors; clusters hold y only, up to 16
    assert all(p[2] <= 8 for p in bwd if not p[3]) and all(p[2] <= 16 for p in bwd)
    long_bwd = softmax_plans.candidates(262144, torch.float32, 2)
    assert (512, 1, 16, True, False) in long_bwd and (512, 1, 8, True, False) in long_bwd
    assert (512, 1, 16, False, False) not in long_bwd


def test_source_commit_can_be_named(monkeypatch):
    monkeypatch.setenv("OPFORGE_SOURCE_COMMIT", "0123abc")
    assert machine.git_commit() == "0123abc"
    monkeypatch.setenv("OPFORGE_SOURCE_COMMIT", "")
    named = machine.git_commit()
    assert named is None or named != "0123abc"


def test_from_json_redraws_a_saved_run(families, tmp_path, capsys):
    saved = tmp_path / "r.json"
    assert cli.main(["bench", "_test_tiny", "--device", "cpu", "--quick", "--json", str(saved), "--no-progress"]) == 0
    first = capsys.readouterr().out.split("wrote")[0]
    run = report.read_json(saved)
    assert report.to_json(run) == json.loads(saved.read_text())  # nothing lost on the way back
    md, png = tmp_path / "again.md", tmp_path / "again.png"
    assert cli.main(["bench", "--from-json", str(saved), "--markdown", str(md), "--plot", str(png)]) == 0
    again = capsys.readouterr().out
    assert again.split("wrote")[0] == first  # the same table, nothing timed
    assert md.read_text().startswith("# opforge benchmark results") and png.stat().st_size > 0
    assert cli.main(["bench", "_test_tiny", "--from-json", str(saved)]) == 2
    assert "--from-json" in capsys.readouterr().out
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"schema": "something-else"}))
    with pytest.raises(ValueError, match="schema"):
        report.read_json(bad)


@pytest.mark.parametrize("relu_output", [False, True])
def test_relu_outputs_near_zero_compare_where_signs_agree(relu_output):
    # Inputs with exact zeros: eager's ReLU passes no gradient there, the
    # "ours" below (nudged by 1e-30) passes it. Both are right to within
    # rounding; only a sign-aware check can say so.
    def make():
        x = torch.randn(4096)
        x[::7] = 0.0
        return [x]

    case = registry.BenchCase(
        op="nudged_relu",
        label="N=4096",
        dtype=torch.float32,
        make_inputs=make,
        ours=lambda x: torch.relu(x + 1e-30),
        eager=torch.relu,
        grad_inputs=(0,),
        relu_output=relu_output,
    )
    if relu_output:
        harness._check_provider(case.ours, case, "bwd", case.eager)
    else:
        with pytest.raises(AssertionError, match="grad of input 0"):
            harness._check_provider(case.ours, case, "bwd", case.eager)
    wrong = dataclasses.replace(case, ours=lambda x: torch.relu(x) * 1.5)  # a real error still fails
    with pytest.raises(AssertionError):
        harness._check_provider(wrong.ours, wrong, "bwd", wrong.eager)


def test_bwd_reference_gets_the_providers_incoming_gradient():
    # A bfloat16 op checked against a float64 reference: both must be handed
    # the same incoming gradient (drawn in bfloat16), else the reference's
    # gradient differs by the rounding of a float64 draw. The op's own
    # backward returns the incoming gradient times 8 (exact in both dtypes),
    # so with the same gradient the two agree exactly, to any tolerance.
    seen = {}

    class Scale8(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 8

        @staticmethod
        def backward(ctx, g):
            seen[g.dtype] = g.detach().clone()
            return g * 8

    case = registry.BenchCase(
        op="scale8",
        label="N=4096",
        dtype=torch.bfloat16,
        make_inputs=lambda: [torch.randn(4096, dtype=torch.bfloat16)],
        ours=Scale8.apply,
        eager=lambda x: x * 8,
        grad_inputs=(0,),
        reference=lambda x: Scale8.apply(x.double()),
        atol=0.0,
        rtol=0.0,
    )
    harness._check_provider(case.ours, case, "bwd", case.reference)
    assert torch.equal(seen[torch.float64], seen[torch.bfloat16].double())


def test_grad_atol_applies_to_the_named_input_only():
    # Input 1's gradient is a long sum (here: off by 1e-3, as rounding over
    # many terms can be); input 0's must still meet the default tolerance.
    def make():
        return [torch.randn(64), torch.randn(())]

    class SumOff(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, s):
            ctx.save_for_backward(x, s)
            return x * s

        @staticmethod
        def backward(ctx, g):
            x, s = ctx.saved_tensors
            return g * s, (g * x).sum() + 1e-3

    base = registry.BenchCase(
        op="sum_off",
        label="N=64",
        dtype=torch.float32,
        make_inputs=make,
        ours=SumOff.apply,
        eager=lambda x, s: x * s,
        grad_inputs=(0, 1),
    )
    with pytest.raises(AssertionError, match="grad of input 1"):
        harness._check_provider(base.ours, base, "bwd", base.eager)
    loose = dataclasses.replace(base, grad_atol={1: 1e-2})
    harness._check_provider(loose.ours, loose, "bwd", loose.eager)
    wrong_x = dataclasses.replace(loose, grad_atol={0: 1e-2})  # input 0 loosened, input 1 still checked
    with pytest.raises(AssertionError, match="grad of input 1"):
        harness._check_provider(wrong_x.ours, wrong_x, "bwd", wrong_x.eager)
