import pytest
import torch

import opforge  # noqa: F401  (loads the kernels once for the whole session)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `make gpu-check` on a GPU machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def pytest_generate_tests(metafunc):
    # Tests that take `device` run on the CPU and, marked `cuda`, on the GPU.
    if "device" in metafunc.fixturenames:
        metafunc.parametrize(
            "device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
        )
