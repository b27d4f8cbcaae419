import sys

import pytest
import torch
from seeding import CASE_ENV, base_seed, reproduce_line, seed_all, seed_for

import opforge  # noqa: F401  (loads the kernels once for the whole session)


def pytest_addoption(parser):
    parser.addoption(
        "--seed",
        type=int,
        default=None,
        help="base seed of the random inputs (default: $OPFORGE_TEST_SEED, else 0); "
        "each test draws from a seed derived from it and the test's node id",
    )


def pytest_configure(config):
    config._opforge_seed = base_seed(config.getoption("seed"))
    # Module-level draws at import (collection) follow the base seed too.
    seed_all(config._opforge_seed)


def pytest_report_header(config):
    return f"opforge test seed: {config._opforge_seed} (change with --seed N or OPFORGE_TEST_SEED=N)"


@pytest.fixture(autouse=True)
def seed(request, monkeypatch):
    """Seeds torch (and CUDA), `random` and numpy from the base seed and the node id, so that a
    test draws the same inputs whatever ran before it; subprocesses get the seed in the env."""
    value = seed_for(request.config._opforge_seed, request.node.nodeid)
    seed_all(value)
    monkeypatch.setenv(CASE_ENV, str(value))
    return value


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed:
        report.sections.append(("reproduce", reproduce_line(item.config._opforge_seed, item.nodeid)))
    return report


NO_GPU = "needs a CUDA GPU (run `make gpu-check` on a GPU machine)"


NO_SECOND_GPU = "needs two CUDA GPUs"


def pytest_collection_modifyitems(config, items):
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if gpus == 0 and ("cuda" in item.keywords or "multigpu" in item.keywords):
            item.add_marker(pytest.mark.skip(reason=NO_GPU))
        elif gpus < 2 and "multigpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=f"{NO_SECOND_GPU} (this machine has {gpus})"))


def pytest_generate_tests(metafunc):
    # Tests that take `device` run on the CPU and, marked `cuda`, on the GPU.
    if "device" in metafunc.fixturenames:
        metafunc.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])


def pytest_terminal_summary(terminalreporter):
    """One line per skip reason with its count; the CUDA tests a machine without a GPU skips
    are one line in all."""
    reasons = {}
    for report in terminalreporter.stats.get("skipped", []):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        reasons[reason] = reasons.get(reason, 0) + 1
    for reason, count in sorted(reasons.items(), key=lambda kv: -kv[1]):
        if reason == NO_GPU:
            terminalreporter.write_line(f"{count} CUDA tests skipped: no GPU")
        else:
            terminalreporter.write_line(f"{count} skipped: {reason}")


@pytest.fixture(autouse=True)
def whole_model_kept(request, monkeypatch):
    """optimize's last check (the whole model timed as optimized and as it was) keeps the optimized
    model, untimed, in every test file but its own: a test of which layers are replaced must not
    turn on the host's timing noise. tests/test_optimize_guard.py runs the check itself."""
    from opforge import optimize_guard

    monkeypatch.setattr(optimize_guard, "_verdicts", {})
    if request.node.path.name != "test_optimize_guard.py":
        monkeypatch.setattr(sys.modules["opforge.optimize"], "keep_optimized", lambda before, inputs: (True, ""))
