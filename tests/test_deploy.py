"""Deployment without Python: an AOTInductor package of a model with opforge ops, run from
Python and by the C++ runner (cpp/runner/opforge_run.cpp), on the CPU and (marked) on CUDA."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from opforge import _loader, deploy, native_build

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "deploy" / "small_detector.py"

pytestmark = pytest.mark.skipif(not deploy.RUNNER_SOURCE.is_file(), reason="needs the source tree's cpp/runner")


def _example():
    spec = importlib.util.spec_from_file_location("small_detector", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.model(), module.example_inputs()


def _close(got, expected):
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g.cpu(), e.cpu(), rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def runner() -> Path:
    try:
        _loader.library_path()
    except ImportError as exc:
        pytest.skip(f"no installed kernel library: {exc}")
    return deploy.build_runner()


def _package(tmp_path_factory, device):
    model, (x,) = _example()
    made = deploy.package(model.to(device), (x.to(device),), tmp_path_factory.mktemp(f"deploy-{device}"))
    return made, model, x.to(device)


@pytest.fixture(scope="module")
def cpu_package(tmp_path_factory):
    return _package(tmp_path_factory, "cpu")


def _run(runner: Path, *args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(runner), *map(str, args)], capture_output=True, text=True, env=native_build.run_env(), timeout=300
    )


def test_package_runs_from_python_as_eager(cpu_package):
    made, model, x = cpu_package
    loaded = torch._inductor.aoti_load_package(str(made.package))
    with torch.no_grad():
        _close(loaded(x), model(x))
        bigger = torch.randn(5, *x.shape[1:])  # the batch dim was exported dynamic
        _close(loaded(bigger), model(bigger))


def test_cpp_runner_matches_eager(cpu_package, runner, tmp_path):
    made, model, x = cpu_package
    out = tmp_path / "output.pt"
    proc = _run(runner, made.package, made.inputs, out, "--expected", made.expected, "--repeat", "3")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "outputs match expected" in proc.stdout and "latency_ms median" in proc.stdout
    with torch.no_grad():
        _close(torch.load(out, weights_only=False), model(x))  # libtorch pickle_save format


def test_runner_and_library_need_no_python(runner):
    for binary in (runner, Path(_loader.library_path())):
        needed = subprocess.run(["readelf", "-d", str(binary)], capture_output=True, text=True, check=True).stdout
        assert "libpython" not in needed and "libtorch_python" not in needed, needed
    deps = subprocess.run(["ldd", str(runner)], capture_output=True, text=True, env=native_build.run_env()).stdout
    assert "libpython" not in deps and "libtorch_python" not in deps, deps


def test_runner_bad_input_is_a_message_and_exit_2(cpu_package, runner, tmp_path):
    made, _, x = cpu_package
    cases = {
        "missing": (tmp_path / "nothere.pt", "cannot read the input file"),
        "wrong_dtype": (tmp_path / "double.pt", "x and weight must have the same dtype"),
        "wrong_shape": (tmp_path / "channels.pt", "input channels"),
    }
    torch.save([x.double()], cases["wrong_dtype"][0])
    torch.save([torch.randn(2, 4, 32, 32)], cases["wrong_shape"][0])
    for name, (path, message) in cases.items():
        proc = _run(runner, made.package, path, tmp_path / "o.pt")
        assert proc.returncode == 2, (name, proc.stdout, proc.stderr)
        assert message in proc.stderr, (name, proc.stderr)
        assert "frame #" not in proc.stderr, proc.stderr  # a message, not a backtrace
    proc = _run(runner, tmp_path / "none.pt2", made.inputs, tmp_path / "o.pt")
    assert proc.returncode == 2 and "cannot read the package file" in proc.stderr
    proc = _run(runner, made.package)
    assert proc.returncode == 2 and "usage:" in proc.stderr


def test_deploy_command(tmp_path):
    from opforge import cli

    assert cli.main(["deploy", str(EXAMPLE), "--out", str(tmp_path), "--static-batch"]) == 0
    assert {p.name for p in tmp_path.iterdir()} >= {"model.pt2", "input.pt", "expected.pt"}
    assert cli.main(["deploy", str(tmp_path / "missing.py"), "--out", str(tmp_path)]) == 2


@pytest.mark.cuda
def test_cuda_package_and_runner(tmp_path, runner):
    # Packaged and loaded in a child process: a crash while loading a CUDA
    # package (seen with torch 2.11's aoti_load_package even for a plain
    # nn.Linear) fails this test instead of ending the whole run.
    code = f"""
import importlib.util, torch
from opforge import deploy
spec = importlib.util.spec_from_file_location("example", {str(EXAMPLE)!r})
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)
model, (x,) = example.model().cuda(), example.example_inputs()
made = deploy.package(model, (x.cuda(),), {str(tmp_path)!r})
loaded = torch._inductor.aoti_load_package(str(made.package))
with torch.no_grad():
    for g, e in zip(loaded(x.cuda()), model(x.cuda())):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)
print("python ok")
"""
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, f"exit {child.returncode}\n{child.stdout}{child.stderr[-3000:]}"
    proc = _run(
        runner,
        tmp_path / "model.pt2",
        tmp_path / "input.pt",
        tmp_path / "out.pt",
        "--expected",
        tmp_path / "expected.pt",
        "--repeat",
        "20",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
