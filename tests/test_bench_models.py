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
    cell = models.Cell("mobilenet_v2", "cpu", "float32", 2, "channels_last", mode, image=32)
    result = models.run_cell(cell, calls=1, repeats=1, only=("eager", "optimize"))
    for name in ("eager", "optimize"):
        t = result.providers[name]
        assert t.status == "ok" and t.ms > 0, t
        assert t.max_rel_error < 1e-4, t
    text = models_report.table([result])
    assert "mobilenet_v2" in text and "optimize / eager" in text
    path = tmp_path / "models.json"
    models_report.write_json([result], str(path), "cpu")
    data = json.loads(path.read_text())
    assert data["schema"] == models_report.SCHEMA and data["results"][0]["cell"]["mode"] == mode
