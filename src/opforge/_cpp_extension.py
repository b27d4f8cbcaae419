"""What ``torch.utils.cpp_extension`` would say, without its import-time side effects.

Importing ``torch.utils.cpp_extension`` costs the whole of torch and guesses
CUDA_HOME at import: from a wrapper ``nvcc`` on PATH it guesses wrongly, and
on a machine without a GPU it logs "No CUDA runtime is found" every time.
The JIT cache paths and torch's version facts below are computed without
importing torch; :func:`import_cpp_extension` imports the module with
CUDA_HOME taken from :func:`opforge.extension.cuda_home`.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import sys
from pathlib import Path

from . import extension


def _torch_dir() -> Path:
    spec = importlib.util.find_spec("torch")  # a top-level find_spec imports nothing
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("torch is not installed in this Python environment")
    return Path(next(iter(spec.submodule_search_locations)))


def torch_version() -> dict[str, str | None]:
    """``__version__``, ``cuda`` and ``hip`` of torch's ``torch/version.py``.

    Read as literals from the file when torch is not imported yet; torch's
    own module otherwise (or when the file is not plain literals).
    """
    keys = ("__version__", "cuda", "hip")
    if "torch" not in sys.modules:
        found: dict[str, object] = {}
        try:
            tree = ast.parse((_torch_dir() / "version.py").read_text())
            for node in tree.body:
                target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
                if isinstance(target, ast.Name) and target.id in keys and node.value is not None:
                    found[target.id] = ast.literal_eval(node.value)
        except (OSError, SyntaxError, ValueError):
            found = {}
        if set(found) == set(keys) and all(v is None or isinstance(v, str) for v in found.values()):
            return {k: found[k] for k in keys}  # type: ignore[misc]
    import torch

    return {"__version__": torch.__version__, "cuda": torch.version.cuda, "hip": torch.version.hip}


def cpp_extension_source() -> str:
    """The text of torch's ``cpp_extension.py`` (to read its flags without importing it)."""
    return (_torch_dir() / "utils" / "cpp_extension.py").read_text()


def default_build_root() -> Path:
    """``cpp_extension.get_default_build_root()``: torch's user cache folder for extensions."""
    if sys.platform == "win32":  # the folder comes from the registry: ask torch
        return Path(import_cpp_extension().get_default_build_root())
    if sys.platform == "darwin":
        base = os.path.expanduser("~/Library/Caches")
    else:  # every other platform follows XDG in torch._appdirs
        base = os.getenv("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))
    return Path(os.path.realpath(os.path.join(base, "torch_extensions")))


def extensions_root() -> Path:
    """The folder holding every JIT build: ``$TORCH_EXTENSIONS_DIR``, else the
    default root plus ``py<major><minor><abiflags>_<cuXYZ|rocmXYZ|cpu>``, as
    ``cpp_extension._get_build_directory`` computes it."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is not None:
        return Path(root)
    version = torch_version()
    if version["hip"] is not None:
        accelerator = "rocm" + version["hip"].replace(".", "")
    elif version["cuda"] is not None:
        accelerator = "cu" + version["cuda"].replace(".", "")
    else:
        accelerator = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return default_build_root() / f"{python}_{accelerator}"


def build_directory(name: str) -> Path:
    """Where ``cpp_extension.load(name=name)`` builds; unlike torch's helper, creates nothing."""
    return Path(os.path.join(extensions_root(), name))


# Lives in extension.py, which setup.py loads by path; kept here under its public name.
import_cpp_extension = extension.import_cpp_extension
