"""tools/model_zoo_check.py: the check it makes of an optimized model, and when it flags one."""

import json
import pathlib
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tools"))

pytest.importorskip("torchvision")

import model_zoo_check  # noqa: E402


def test_checks_a_model_in_eval_and_training_against_float64(tmp_path):
    # force: every layer opforge has a kernel for is swapped whatever the timing, so both modes compare something.
    out = tmp_path / "zoo.json"
    argv = ["--models", "squeezenet1_1", "--image", "64", "--force", "--json", str(out)]
    assert model_zoo_check.main(argv) == 0
    (row,) = json.loads(out.read_text())["results"]
    assert row["model"] == "squeezenet1_1" and row["flag"] == "ok" and row["worse"] == []
    assert row["eval"]["replaced"] > 0 and row["train"]["replaced"] > 0
    assert 0 < row["eval"]["original_outputs_vs_float64"] < 1e-5  # float32 rounding, measured
    assert row["eval"]["outputs_vs_float64"] < 1e-5
    assert row["train"]["gradients_vs_float64"] < 1e-3
    assert row["eval"]["outputs_in_float64_vs_float64"] < 1e-12  # the same math, in float64
    assert row["train"]["gradients_in_float64_vs_float64"] < 1e-12
    names = {name for name, _ in model_zoo_check.randomized("squeezenet1_1").named_parameters()}
    assert row["train"]["worst_gradients"] in names


def test_flags_any_item_in_float64_and_the_worst_float32_item():
    # float64: each item against EXACT, so no parameter's error hides behind another's.
    r = model_zoo_check._compare("gradients", [1e-3, 5e-3], [5e-3, 1e-3], ["a", "b"], [1e-15, 1e-6])
    assert r["worse_gradients"] == ["b in float64"] and r["worst_gradients"] == "b"
    assert r["float32_gradients_beyond_original"] == ["b"]  # listed, judged model-wide: 5e-3 < 2 * 5e-3
    r = model_zoo_check._compare("gradients", [3e-2], [1e-2], ["a"], [1e-15])
    assert r["worse_gradients"] == ["float32 gradients"]
    assert model_zoo_check._compare("outputs", [2e-6], [1e-6], ["output 0"], [0.0])["worse_outputs"] == []
    assert model_zoo_check._compare("loss", [3e-5], [1e-6], ["loss"], [0.0])["worse_loss"] == ["float32 loss"]
    # The original's error per item: the larger of its two layouts'.
    assert model_zoo_check._baseline([1e-3, 2e-3], [3e-3, 1e-3]) == [3e-3, 2e-3]


def test_counts_parameters_of_models_that_build_on_meta_and_of_those_that_do_not():
    for name in ("squeezenet1_1", "regnet_y_400mf"):  # regnet's constructor reads tensor values
        model = model_zoo_check.randomized(name)
        assert model_zoo_check.parameter_count(name) == sum(p.numel() for p in model.parameters())


def test_a_model_optimize_cannot_take_is_reported_not_raised(monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise RuntimeError("no")

    monkeypatch.setattr(model_zoo_check.opforge, "optimize", broken)
    assert model_zoo_check.main(["--models", "squeezenet1_1", "--image", "32"]) == 1
    captured = capsys.readouterr()
    assert "FAILED RuntimeError" in captured.out
    assert "Traceback" in captured.err  # what raised, for a bug in the tool itself too


def test_each_model_gets_an_input_size_it_can_take():
    assert model_zoo_check.image_size("resnet18", 96) == 96
    assert model_zoo_check.image_size("inception_v3", 96) == 299
    # maxvit_t's last stage runs at 1/32 of the input in 7x7 partitions.
    assert [model_zoo_check.image_size("maxvit_t", s) for s in (96, 224, 300)] == [224, 224, 448]
    with torch.no_grad():
        out = model_zoo_check.randomized("maxvit_t", 448).eval()(torch.randn(1, 3, 448, 448))
    assert out.shape == (1, 1000)
