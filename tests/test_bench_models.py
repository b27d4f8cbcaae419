"""opforge bench models: cells, providers and the report, on a small input (no timing claims)."""

import json

import pytest

pytest.importorskip("torchvision")

from opforge.bench import models, models_report  # noqa: E402


def test_cpu_cells_skip_what_does_not_apply():
    cells = models.cells(["cpu"], ["resnet18"], ["float32", "bfloat16"], [1], ["nchw"], ["inference", "train"])
    assert [(c.dtype, c.mode) for c in cells] == [("float32", "inference"), ("float32", "train")]
    assert "compile_ro" not in models.providers_for(cells[0])
    assert "compile_freezing" not in models.providers_for(cells[1])


@pytest.mark.parametrize("mode", ["inference", "train"])
def test_run_cell_checks_outputs_and_reports(mode, tmp_path):
    # 64x64: at 32x32 the last training BatchNorms normalize two values per channel (batch 2,
    # 1x1), where the eager float32 output is itself 67% off float64's, so any other rounding
    # (opforge's convs, taken in training where they time faster) moves it as far.
    cell = models.Cell("mobilenet_v2", "cpu", "float32", 2, "channels_last", mode, image=64)
    result = models.run_cell(cell, calls=1, repeats=3, only=("eager", "optimize"))
    for name in ("eager", "optimize"):
        t = result.providers[name]
        assert t.status == "ok" and t.ms > 0, t
        assert t.max_rel_error < 1e-4, t
        # The median comes with the rounds it was taken from.
        assert len(t.rounds_ms) == 3 and sorted(t.rounds_ms)[1] == pytest.approx(t.ms, rel=1e-3), t
    # What optimize did rides along with its time: the layer count and the model-level notes.
    assert result.providers["eager"].optimized is None
    assert " of 52 layers changed" in result.providers["optimize"].optimized
    text = models_report.table([result])
    assert "mobilenet_v2" in text and "optimize / eager" in text
    path = tmp_path / "models.json"
    models_report.write_json([result], str(path), "cpu")
    data = json.loads(path.read_text())
    assert data["schema"] == models_report.SCHEMA and data["results"][0]["cell"]["mode"] == mode
    assert data["results"][0]["providers"]["optimize"]["optimized"] == result.providers["optimize"].optimized
    _, back = models_report.read_json(str(path))
    assert back[0].providers["optimize"].optimized == result.providers["optimize"].optimized
    assert back[0].providers["eager"].rounds_ms == result.providers["eager"].rounds_ms


def test_merge_reads_back_what_was_written(tmp_path):
    """Runs made apart merge into one table: `opforge bench models --merge a.json b.json`."""
    import subprocess
    import sys

    env = {"gpu": "Test GPU", "torch": "x"}
    paths = []
    for i, model in enumerate(("mobilenet_v2", "resnet18")):
        cell = models.Cell(model, "cuda", "bfloat16", 64, "channels_last", "inference")
        timed = {"eager": models.Timed(2.0 + i, 1e-3), "optimize": models.Timed(1.0, 2e-3)}
        paths.append(tmp_path / f"{model}.json")
        models_report.write_json([models.CellResult(cell, timed)], str(paths[-1]), "cuda", env)
    env_back, results = models_report.read_json(str(paths[1]))
    assert env_back == env and results[0].providers["eager"].ms == 3.0
    out, chart = tmp_path / "merged.md", tmp_path / "merged.png"
    cmd = [sys.executable, "-m", "opforge", "bench", "models", "--merge", *map(str, paths), "--markdown", str(out)]
    subprocess.run(cmd + ["--plot", str(chart)], check=True, capture_output=True)
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = out.read_text()
    assert "Test GPU" in text and "| mobilenet_v2 |" in text and "| resnet18 |" in text
    assert "| 2.00x |" in text and "| 3.00x |" in text  # optimize / eager per row
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"schema": "other"}))
    with pytest.raises(ValueError, match="not an opforge bench models result"):
        models_report.read_json(str(bad))


def _fake_result(cell, eager_ms):
    return models.CellResult(cell, {"eager": models.Timed(eager_ms, 0.0), "optimize": models.Timed(1.0, 1e-6)})


def test_merge_keeps_the_last_result_of_a_cell(tmp_path):
    a = models.Cell("mobilenet_v2", "cpu", "float32", 1, "nchw", "inference")
    b = models.Cell("resnet18", "cpu", "float32", 1, "nchw", "inference")
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    models_report.write_json([_fake_result(a, 2.0), _fake_result(b, 5.0)], str(first), "cpu", {"torch": "x"})
    models_report.write_json([_fake_result(a, 3.0)], str(second), "cpu", {"torch": "x"})
    merged = tmp_path / "merged.json"
    from opforge import cli

    assert cli.main(["bench", "models", "--merge", str(first), str(second), "--json", str(merged)]) == 0
    _, results = models_report.read_json(str(merged))
    assert [r.cell.model for r in results] == ["mobilenet_v2", "resnet18"]
    assert [r.providers["eager"].ms for r in results] == [3.0, 5.0]


def test_merged_cells_name_the_run_that_measured_them(tmp_path):
    """A merged table of several runs names, per cell, the sources, date and machine of its run;
    the file's own environment keeps only what the runs share."""
    from opforge import cli

    a = models.Cell("mobilenet_v2", "cuda", "float32", 1, "nchw", "inference")
    b = models.Cell("resnet18", "cuda", "float32", 1, "nchw", "inference")
    run1 = {"gpu": "Test GPU", "torch": "x", "git_commit": "1" * 40, "date_utc": "2026-01-01T00:00:00Z"}
    run2 = {"gpu": "Test GPU", "torch": "x", "git_commit": "2" * 40, "date_utc": "2026-02-01T00:00:00Z"}
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    models_report.write_json([_fake_result(a, 2.0), _fake_result(b, 5.0)], str(first), "cuda", run1)
    models_report.write_json([_fake_result(a, 3.0)], str(second), "cuda", run2)
    merged, md = tmp_path / "merged.json", tmp_path / "merged.md"
    argv = ["bench", "models", "--merge", str(first), str(second), "--json", str(merged), "--markdown", str(md)]
    assert cli.main(argv) == 0
    env, results = models_report.read_json(str(merged))
    assert env == {"gpu": "Test GPU", "torch": "x"}
    assert [r.environment["git_commit"] for r in results] == ["2" * 40, "1" * 40]
    text = md.read_text()
    assert "| run |" in text and "Measured in 2 runs:" in text
    assert "| mobilenet_v2 |" in text and text.split("| mobilenet_v2 |")[1].split("\n")[0].endswith("| 1 |")
    assert text.split("| resnet18 |")[1].split("\n")[0].endswith("| 2 |")
    assert "- run 1: sources 2222222, 2026-02-01, Test GPU, torch x: 1 cell" in text
    assert "- run 2: sources 1111111, 2026-01-01, Test GPU, torch x: 1 cell" in text
    # Merged again, with nothing new, the file reads back the same: each cell keeps its run.
    again = tmp_path / "again.json"
    assert cli.main(["bench", "models", "--merge", str(merged), "--json", str(again)]) == 0
    env2, results2 = models_report.read_json(str(again))
    assert env2 == env and [r.environment for r in results2] == [r.environment for r in results]
    # One run's file, merged alone, names no run per cell: its environment is the file's.
    alone, alone_md = tmp_path / "alone.json", tmp_path / "alone.md"
    assert cli.main(["bench", "models", "--merge", str(first), "--json", str(alone), "--markdown", str(alone_md)]) == 0
    single = json.loads(alone.read_text())
    assert single["environment"] == run1 and all("environment" not in r for r in single["results"])
    assert "| run |" not in alone_md.read_text()
    # Commands of one run, minutes apart (same sources and machine, other dates): one run.
    later = tmp_path / "later.json"
    models_report.write_json([_fake_result(a, 4.0)], str(later), "cuda", {**run1, "date_utc": "2026-01-02T00:00:00Z"})
    same_md = tmp_path / "same.md"
    assert cli.main(["bench", "models", "--merge", str(first), str(later), "--markdown", str(same_md)]) == 0
    assert "| run |" not in same_md.read_text()


def test_merge_reads_fields_it_does_not_know(tmp_path):
    """A file from a later version, with a provider field this one lacks, still merges."""
    cell = models.Cell("resnet18", "cpu", "float32", 1, "nchw", "inference")
    path = tmp_path / "newer.json"
    models_report.write_json([_fake_result(cell, 2.0)], str(path), "cpu", {"torch": "x"})
    data = json.loads(path.read_text())
    data["results"][0]["providers"]["eager"]["a_later_field"] = 1
    path.write_text(json.dumps(data))
    _, results = models_report.read_json(str(path))
    assert results[0].providers["eager"].ms == 2.0


def test_json_is_written_after_every_cell(tmp_path, monkeypatch):
    """A run stopped after its first cell leaves that cell in the --json file."""
    done = []

    def fake_run_cell(cell, calls, repeats, only=()):
        if done:
            raise KeyboardInterrupt
        done.append(cell)
        return _fake_result(cell, 2.0)

    monkeypatch.setattr(models, "run_cell", fake_run_cell)
    path = tmp_path / "run.json"
    from opforge import cli

    args = ["bench", "models", "--device", "cpu", "--models", "mobilenet_v2,resnet18", "--modes", "inference"]
    with pytest.raises(KeyboardInterrupt):
        cli.main(args + ["--layouts", "nchw", "--json", str(path), "--no-progress"])
    env, results = models_report.read_json(str(path))
    assert [r.cell for r in results] == done and env["device"] == "cpu"
    assert not (tmp_path / "run.json.tmp").exists()


def test_report_line_counts_what_layers_became():
    from opforge.optimize_report import LayerReport, OptimizeReport

    rows = [
        LayerReport("a", "Conv2d(3x3)", "opforge conv2d_3x3"),
        LayerReport("b", "Conv2d(3x3)", "opforge conv2d_3x3"),
        LayerReport("c", "Conv2d(1x1)", "BatchNorm folded"),
        LayerReport("d", "Conv2d(5x5)", "left", "opforge has no kernel for this conv"),
    ]
    line = models.report_line(OptimizeReport(rows, ["NCHW kept"]))
    assert line == "3 of 4 layers changed (2x opforge conv2d_3x3, 1x BatchNorm folded); NCHW kept"
    assert models.report_line(OptimizeReport(rows[3:])) == "0 of 1 layers changed"


def test_from_json_redraws_a_saved_run_without_timing(tmp_path, monkeypatch):
    cell = models.Cell("resnet18", "cpu", "float32", 1, "nchw", "inference")
    saved, md = tmp_path / "saved.json", tmp_path / "saved.md"
    models_report.write_json([_fake_result(cell, 4.0)], str(saved), "cpu", {"torch": "x"})

    def no_timing(*args, **kwargs):
        raise AssertionError("--from-json timed a cell")

    monkeypatch.setattr(models, "run_cell", no_timing)
    from opforge import cli

    assert cli.main(["bench", "models", "--from-json", str(saved), "--markdown", str(md)]) == 0
    assert "| resnet18 | float32 | 1 | nchw | inference | 4.00 |" in md.read_text()


@pytest.mark.parametrize(
    "argv, said",
    [
        (["bench", "models", "resnet18"], "takes no OPS (got resnet18); name models with --models"),
        (["bench", "models", "--dtype", "bf16"], "--dtype is the op benchmark's; use --dtypes"),
        (["bench", "models", "--mode", "fwd"], "--mode is the op benchmark's; use --modes"),
        (["bench", "models", "--no-compile"], "choose providers with --providers"),
        (["bench", "models", "--calls", "5"], "--calls applies to `opforge bench overhead` only"),
        (["bench", "models", "--from-json", "a.json", "--merge", "b.json"], "give one of them"),
        (["bench", "models", "--merge", "a.json", "--models", "resnet18"], "--merge runs nothing; --models"),
        (["bench", "models", "--from-json", "a.json", "--json", "b.json"], "--from-json redraws a saved run"),
        (["bench", "softmax", "--models", "resnet18"], "--models applies to `opforge bench models` only"),
        (["bench", "overhead", "--batches", "1", "--image", "64"], "--batches, --image apply to"),
        (["bench", "softmax", "--image", "224"], "--image applies to `opforge bench models` only"),
        (["bench", "models", "--repeats", "3", "--threads", "1"], "--repeats, --threads apply to `opforge bench"),
        (["bench", "softmax", "--threads", "1"], "--threads applies to `opforge bench overhead` only"),
        (["bench", "overhead", "--from-json", "a.json", "--calls", "5"], "--from-json redraws a saved run"),
        (["bench", "--from-json", "a.json", "--no-compile"], "--from-json redraws a saved run"),
        (["bench", "models", "--merge", "a.json", "--device", "cpu"], "--merge runs nothing; --device"),
        (["bench", "models", "--from-json", "a.json", "--quick"], "--from-json runs nothing; --quick"),
    ],
)
def test_options_that_would_be_ignored_are_refused(argv, said, capsys, monkeypatch):
    def no_timing(*args, **kwargs):
        raise AssertionError("a refused command timed something")

    monkeypatch.setattr(models, "run_cell", no_timing)
    from opforge import cli

    assert cli.main(argv) == 2
    assert said in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv", [["--batches", "x"], ["--batches", "0,1"], ["--batches", ","], ["--image", "-3"], ["--image", "1,2"]]
)
def test_cell_sizes_must_be_positive_integers(argv, capsys):
    from opforge import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "models", *argv])
    assert exit_info.value.code == 2
    assert f"argument {argv[0]}: expected a positive integer" in capsys.readouterr().err


def test_sizes_reach_the_cells_and_defaults_refuse_nothing(monkeypatch):
    from opforge import cli
    from opforge.bench import cli_args, models_cli, overhead_cli

    defaults = cli_args.demo_args()
    assert models_cli.own_options_given(defaults) == [] and overhead_cli.own_options_given(defaults) == []
    ran = []

    def fake_run_cell(cell, calls, repeats, only=()):
        ran.append(cell)
        return _fake_result(cell, 2.0)

    monkeypatch.setattr(models, "run_cell", fake_run_cell)
    argv = ["bench", "models", "--device", "cpu", "--models", "resnet18", "--layouts", "nchw", "--modes", "inference"]
    assert cli.main(argv + ["--batches", "1, 2", "--image", " 64", "--no-progress"]) == 0
    assert [(c.batch, c.image) for c in ran] == [(1, 64), (2, 64)]
    ran.clear()
    assert cli.main(argv + ["--no-progress"]) == 0
    assert [(c.batch, c.image) for c in ran] == [(1, 224)]


def test_from_json_of_another_kind_is_refused(tmp_path, capsys):
    from opforge import cli

    other = tmp_path / "ops.json"
    other.write_text(json.dumps({"schema": "opforge-bench/1", "results": []}))
    assert cli.main(["bench", "models", "--from-json", str(other)]) == 2
    assert "not an opforge bench models result" in capsys.readouterr().out
    assert cli.main(["bench", "models", "--from-json", str(tmp_path / "missing.json")]) == 2
    assert "cannot read" in capsys.readouterr().out
