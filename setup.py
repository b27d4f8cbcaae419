"""Installed build of opforge: ``pip install --no-build-isolation .`` (or ``-e .``).

CPU kernels are always built; CUDA kernels when torch has CUDA and nvcc is
found (``OPFORGE_CUDA=0|1`` forces either). ``TORCH_CUDA_ARCH_LIST`` and
``MAX_JOBS`` are honoured. The source list lives in src/opforge/_build.py,
shared with the JIT build.
"""

import importlib.util
from pathlib import Path

from setuptools import setup

# Load the build description by path: the opforge package cannot be imported
# before its kernels exist.
_spec = importlib.util.spec_from_file_location("_opforge_build", Path(__file__).parent / "src" / "opforge" / "_build.py")
_build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_build)

# Before torch.utils.cpp_extension is imported: it reads CUDA_HOME at import.
extension = _build.setup_extension()

from torch.utils.cpp_extension import BuildExtension  # noqa: E402

setup(
    ext_modules=[extension],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
