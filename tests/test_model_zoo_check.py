"""tools/model_zoo_check.py: the check it makes of an optimized model, and when it flags one."""

import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tools"))

pytest.importorskip("torchvision")

import model_zoo_check  # noqa: E402


def test_checks_a_model_in_eval_and_training_against_float64(tmp_path):
    out = tmp_path / "zoo.json"
    assert model_zoo_check.main(["--models", "squeezenet1_1", "--image", "64", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["results"]
    assert row["model"] == "squeezenet1_1" and row["flag"] == "ok"
    assert row["eval"]["replaced"] > 0  # its convs + ReLU are fused: the check compares something
    assert 0 < row["eval"]["original_vs_float64"] < 1e-5  # float32 rounding, measured
    assert row["eval"]["optimized_vs_float64"] < 1e-5
    assert row["train"]["optimized_vs_float64"] < 1e-3


def test_flags_an_optimized_model_farther_from_float64_than_twice_the_original():
    assert not model_zoo_check.worse("eval", {"optimized_vs_float64": 2e-6, "original_vs_float64": 1e-6})
    assert model_zoo_check.worse("eval", {"optimized_vs_float64": 3e-5, "original_vs_float64": 1e-6})
    assert model_zoo_check.worse("train", {"optimized_vs_float64": 5e-2, "original_vs_float64": 1e-2})


def test_a_model_optimize_cannot_take_is_reported_not_raised(monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise RuntimeError("no")

    monkeypatch.setattr(model_zoo_check.opforge, "optimize", broken)
    assert model_zoo_check.main(["--models", "squeezenet1_1", "--image", "32"]) == 1
    assert "FAILED RuntimeError" in capsys.readouterr().out
