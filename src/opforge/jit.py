"""JIT build of opforge's kernels (the dynamic-load path).

``opforge.jit.load()`` compiles the same source list as the installed build
(see ``opforge._build``) with ``torch.utils.cpp_extension.load`` into the
torch extensions cache (``TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``)
and loads it. Only changed files are recompiled; a failed build raises
:class:`opforge.extension.BuildError` carrying the compiler's own error; a
lock left by an interrupted build is detected and cleared.

Set ``OPFORGE_JIT=1`` to make ``import opforge`` use this path instead of the
installed ``opforge._C``. ``OPFORGE_CUDA=0`` builds the CPU kernels only.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from . import _cpp_extension, extension
from ._build import SOURCES

_loaded: str | None = None


def load(verbose: bool = False) -> str:
    """Build (if needed) and load the kernels; returns the library's path.

    Calling it again in the same process returns the already loaded path.
    """
    global _loaded
    if _loaded is None:
        _cpp_extension.import_cpp_extension()  # before jit_load imports it: CUDA_HOME is opforge's, not torch's guess
        _loaded = extension.jit_load(SOURCES, verbose=verbose)
    return _loaded


def cache_dir() -> Path:
    """The folder the JIT build uses (``extension.jit_build_directory``'s answer,
    computed without importing torch and without creating it)."""
    return _cpp_extension.build_directory(SOURCES.name)


def clear_cache() -> Path | None:
    """Remove opforge's JIT build folder; returns what was removed, if anything."""
    path = cache_dir()
    if path.exists():
        shutil.rmtree(path)
        return path
    return None
