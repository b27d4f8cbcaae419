"""Loads opforge's compiled kernels: the installed ``opforge._C`` or a JIT build.

A missing or mismatched build is an ImportError that says what to run;
opforge never carries on without its kernels.
"""

from __future__ import annotations

import importlib
import os

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


def load() -> None:
    global source
    if source is not None:
        return
    if os.environ.get("OPFORGE_JIT", "") not in ("", "0"):
        from . import jit

        source = "jit:" + jit.load()
    else:
        try:
            # Importing it runs the op registrations. import_module, not `from . import _C`:
            # that misreports a missing file as a circular import while opforge initialises.
            importlib.import_module(f"{__package__}._C")
        except (ImportError, OSError) as exc:
            raise ImportError(f"opforge's compiled kernels (opforge._C) could not be loaded: {exc}. {_FIX}") from None
        source = "installed"
    check_torch_version(build_info()["torch"], torch.__version__)


def check_torch_version(built_for: str, running: str) -> None:
    """Kernels built against one torch release must not run under another."""
    if built_for != _torch_minor(running):
        raise ImportError(
            f"opforge's kernels were built for torch {built_for} but torch {_torch_minor(running)} is installed. "
            f"Rebuild them: {_FIX}"
        )
