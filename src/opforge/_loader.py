"""Loads opforge's compiled kernels: the installed ``opforge._C`` or a JIT build.

``opforge._C`` (``_C.abi3.so`` next to this file) is a plain shared library,
not a Python module: it needs no Python symbol, so C++ programs load it too
(docs/cpp.md). Python loads it with ``torch.ops.load_library``, which runs its
op registrations. A missing or mismatched build is an ImportError that says
what to run; opforge never carries on without its kernels.
"""

from __future__ import annotations

import importlib.machinery
import os
from pathlib import Path

import torch

_FIX = (
    "Build it from the opforge source tree with `pip install --no-build-isolation -e .` "
    "(or `make build`), or set OPFORGE_JIT=1 to compile the kernels at import time."
)

# How the kernels were loaded: "installed" or "jit:<path>".
source: str | None = None


def build_info() -> dict[str, str]:
    """What the loaded library was built with: torch, cuda, archs (loading it first if needed)."""
    if source is None:
        load()
    raw = torch.ops.opforge._build_info()
    info = dict(item.split("=", 1) for item in raw.split(";"))
    if info.get("cuda", "none") != "none":  # encoded as major * 100 + minor
        info["cuda"] = f"{int(info['cuda']) // 100}.{int(info['cuda']) % 100}"
        info["archs"] = ", ".join(f"sm_{a}" for a in info["archs"].split("_"))
    return info


def describe_build(info: dict[str, str] | None = None) -> str:
    """One line of text on the loaded kernels: where from and what they were built with."""
    info = build_info() if info is None else info
    cuda = (
        f"CUDA kernels for CUDA {info['cuda']} ({info['archs']})"
        if info.get("cuda", "none") != "none"
        else "no CUDA kernels"
    )
    cpu = f"CPU kernels up to {info['cpu_isa']}" if info.get("cpu_isa") else "CPU kernels"
    return f"{source or 'not loaded'}, built for torch {info['torch']}: {cpu}, {cuda}"


def _torch_minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def library_path() -> str:
    """The installed kernel library: ``_C`` with the first suffix Python's own
    import would pick (``_C.abi3.so`` for opforge's builds), next to this file.

    Raises ImportError (saying what to run) when there is none.
    """
    folder = Path(__file__).resolve().parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = folder / f"_C{suffix}"
        if path.is_file():
            return str(path)
    raise ImportError(f"opforge's compiled kernels (opforge._C) could not be loaded: no _C.abi3.so in {folder}. {_FIX}")


def _load_library(path: str) -> None:
    # load_library raises OSError("Could not load this library: <path>") with the
    # loader's own reason (an undefined symbol: built for another torch) as its cause.
    try:
        torch.ops.load_library(path)
    except OSError as exc:
        reason = exc.__cause__ or exc
        raise ImportError(f"opforge's compiled kernels (opforge._C) could not be loaded: {reason}. {_FIX}") from None


def load() -> None:
    global source
    if source is not None:
        return
    if os.environ.get("OPFORGE_JIT", "") not in ("", "0"):
        from . import jit

        source = "jit:" + jit.load()
    else:
        _load_library(library_path())
        source = "installed"
    check_torch_version(build_info()["torch"], torch.__version__)


def check_torch_version(built_for: str, running: str) -> None:
    """Kernels built against one torch release must not run under another."""
    if built_for != _torch_minor(running):
        raise ImportError(
            f"opforge's kernels were built for torch {built_for} but torch {_torch_minor(running)} is installed. "
            f"Rebuild them: {_FIX}"
        )
