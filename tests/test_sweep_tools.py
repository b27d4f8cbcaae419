"""The layer sweeps under tools/: shapes collected from the models, the checks each case makes, the shared order."""

import pathlib
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tools"))

import batch_norm_sweep  # noqa: E402
import sweep_common  # noqa: E402

pytest.importorskip("torchvision")


def test_batch_norm_shapes_come_from_the_models():
    shapes = batch_norm_sweep.collect_shapes(("resnet18",))
    # resnet18's stem (3 -> 64, 7x7, stride 2, padding 3 at 224x224) and its strided 1x1 downsample.
    assert shapes[(3, 64, 7, 7, 224, 224, 2, 3, 1)] == ["resnet18"]
    assert (64, 128, 1, 1, 56, 56, 2, 0, 1) in shapes
    assert all(len(key) == 9 for key in shapes)


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("channels_last", [False, True])
def test_batch_norm_case_checks_against_float64(residual, channels_last):
    # A 3x3 depthwise and a 1x1 dense layer, small: (C, K, kH, kW, H, W, stride, padding, groups).
    for key in ((8, 8, 3, 3, 9, 7, 2, 1, 8), (6, 10, 1, 1, 5, 5, 1, 0, 1)):
        case = batch_norm_sweep.run_case(key, 3, torch.float32, channels_last, residual, device="cpu")
        assert case["max_rel_err"] < 1e-5 and case["grad_rel_err"] < 1e-4, case
        assert case["peer_max_rel_err"] < 1e-5 and case["peer_grad_rel_err"] < 1e-4, case
        assert all(ms > 0 for ms in (*case["fwd"], *case["full"]))


def test_fair_order_is_fixed_and_capped():
    shapes = {(i,): [str(i)] for i in range(20)}
    first, again = list(sweep_common.fair_order(shapes, None)), list(sweep_common.fair_order(shapes, None))
    assert first == again and sorted(first) == sorted(shapes.items()) and first != sorted(shapes.items())
    assert list(sweep_common.fair_order(shapes, -1.0)) == []


def test_sweep_arguments():
    ap = sweep_common.sweep_parser("A sweep.\n\nMore.", "8", "the peer")
    args = sweep_common.parse_sweep_args(ap, ["--device", "cpu", "--dtypes", "float32,bfloat16"], "a_sweep")
    assert args.dtypes == [torch.float32, torch.bfloat16] and args.batches == "8" and args.max_seconds is None
    if not torch.cuda.is_available():
        assert sweep_common.parse_sweep_args(ap, [], "a_sweep") is None
