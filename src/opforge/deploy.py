"""``opforge deploy``: a Python model and an example input, as a package a C++ program runs without Python.

Steps: ``torch.export.export`` (dim 0 of every input may vary with
``dynamic_batch``), ``torch._inductor.aoti_compile_and_package`` into
``model.pt2`` for the example inputs' device, and beside it ``input.pt``
(the example inputs) and ``expected.pt`` (the eager model's outputs on
them), both written with ``torch.save`` so that libtorch's
``torch::pickle_load`` reads them. The C++ runner (``cpp/runner``; see
docs/deploy.md) loads opforge's kernel library and the package, and runs it.

A model script for the command defines ``model`` (an ``nn.Module`` or a
function returning one) and ``example_inputs`` (a tuple of tensors, or a
function returning one).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import time
from pathlib import Path


@dataclasses.dataclass
class Package:
    directory: Path
    package: Path  # model.pt2
    inputs: Path  # input.pt
    expected: Path  # expected.pt
    compile_seconds: float
    package_bytes: int


def _as_tuple(outputs):
    return tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)


def package(model, example_inputs: tuple, directory, *, dynamic_batch: bool = True) -> Package:
    """Exports ``model`` on ``example_inputs`` and compiles it into ``directory/model.pt2`` (AOTInductor)."""
    import torch

    from . import _loader

    _loader.load()
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"opforge deploy: model must be a torch.nn.Module, got {type(model).__name__}")
    example_inputs = _as_tuple(example_inputs)
    if not example_inputs or not all(isinstance(t, torch.Tensor) for t in example_inputs):
        raise TypeError("opforge deploy: example_inputs must be a tuple of tensors")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model = model.eval()
    dynamic = None
    if dynamic_batch:
        batch = torch.export.Dim("batch", min=1, max=1 << 16)
        n = example_inputs[0].shape[0] if example_inputs[0].dim() else None
        if n is not None and n < 2:
            # torch.export specializes sizes 0 and 1, so such an example cannot show a varying batch.
            raise ValueError(
                "an example batch of 1 cannot export a dynamic batch size: give an example batch of 2 or "
                "more, or a static batch (--static-batch, dynamic_batch=False)"
            )
        dynamic = tuple({0: batch} if t.dim() and t.shape[0] == n else None for t in example_inputs)
    start = time.perf_counter()
    with torch.no_grad():
        expected = _as_tuple(model(*example_inputs))
        program = torch.export.export(model, example_inputs, dynamic_shapes=dynamic)
        path = torch._inductor.aoti_compile_and_package(program, package_path=str(directory / "model.pt2"))
    seconds = time.perf_counter() - start
    torch.save(list(example_inputs), directory / "input.pt")
    torch.save([t.detach() for t in expected], directory / "expected.pt")
    return Package(
        directory, Path(path), directory / "input.pt", directory / "expected.pt", seconds, Path(path).stat().st_size
    )


def load_script(path: str):
    """(model, example_inputs) defined by a model script (see the module's docs)."""
    spec = importlib.util.spec_from_file_location("opforge_deploy_model", path)
    if spec is None or spec.loader is None:
        raise FileNotFoundError(f"opforge deploy: cannot read the model script {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name in ("model", "example_inputs"):
        if not hasattr(module, name):
            raise AttributeError(f"opforge deploy: {path} must define `{name}`")
    model = module.model() if callable(module.model) and not hasattr(module.model, "forward") else module.model
    inputs = module.example_inputs() if callable(module.example_inputs) else module.example_inputs
    return model, _as_tuple(inputs)


RUNNER_SOURCE = Path(__file__).resolve().parents[2] / "cpp" / "runner" / "opforge_run.cpp"


def runner_source() -> Path:
    """cpp/runner/opforge_run.cpp of the source tree (the runner is built from source)."""
    if not RUNNER_SOURCE.is_file():
        raise FileNotFoundError(
            f"opforge deploy: the runner's source {RUNNER_SOURCE} is missing; the runner is built from a "
            "source checkout of opforge"
        )
    return RUNNER_SOURCE


def build_runner(cache: Path | None = None) -> Path:
    """Builds (once per change) ``opforge_run`` against this torch's libtorch, linked with
    opforge's kernel library; returns its path."""
    from . import _loader, native_build

    source = runner_source()
    cache = cache or source.parents[2] / "build" / "runner"
    programs = native_build.build_programs(
        source, cache, {"opforge_run": (("torch", "torch_cpu", "c10"), _loader.library_path())}
    )
    return programs["opforge_run"]


def main(script: str, out: str, *, dynamic_batch: bool, runner: bool) -> int:
    import sys

    try:
        model, inputs = load_script(script)
        made = package(model, inputs, out, dynamic_batch=dynamic_batch)
    except (OSError, TypeError, AttributeError, ValueError) as exc:
        print(f"opforge deploy: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {made.package} ({made.package_bytes / 1e6:.1f} MB, compiled in {made.compile_seconds:.0f} s)")
    print(f"wrote {made.inputs} and {made.expected}")
    if runner:
        binary = build_runner()
        print(f"runner: {binary}")
        print(f"run it: {binary} {made.package} {made.inputs} output.pt --expected {made.expected}")
    return 0
