"""Installed build of opforge: ``pip install --no-build-isolation .`` (or ``-e .``).

CPU kernels are always built; CUDA kernels when torch has CUDA and nvcc is
found (``OPFORGE_CUDA=0|1`` forces either). ``TORCH_CUDA_ARCH_LIST`` and
``MAX_JOBS`` are honoured. The source list lives in src/opforge/_build.py,
shared with the JIT build.

``OPFORGE_BUILD_EXT=0`` installs the Python package alone: ``make build``
installs it so once, then builds the kernels in place with ``tools/build.py``,
whose object files stay in ``build/`` for incremental rebuilds.
"""

import importlib.util
import os
from pathlib import Path

from setuptools import setup


def _kernel_build_options() -> dict:
    # Load the build description by path: the opforge package cannot be
    # imported before its kernels exist.
    spec = importlib.util.spec_from_file_location("_opforge_build", Path(__file__).parent / "src" / "opforge" / "_build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    # Before torch.utils.cpp_extension is imported: it reads CUDA_HOME at import.
    extension = build.setup_extension()
    from torch.utils.cpp_extension import BuildExtension

    return dict(
        ext_modules=[extension],
        cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
        options={"bdist_wheel": {"py_limited_api": "cp310"}},
    )


setup(**({} if os.environ.get("OPFORGE_BUILD_EXT", "1") == "0" else _kernel_build_options()))
