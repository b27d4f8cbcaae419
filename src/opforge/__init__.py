"""opforge: fast fused PyTorch operators in C++ (CPU) and CUDA (GPU).

Every op is a real torch op in the ``opforge`` namespace
(``torch.ops.opforge.add_relu``) with autograd, fake kernels for
``torch.compile``, and float32/float64/float16/bfloat16 support::

    import torch, opforge
    y = opforge.add_relu(x, bias)        # relu(x + bias) in one kernel

Importing opforge loads its compiled kernels (the installed ``opforge._C``,
or a JIT build with ``OPFORGE_JIT=1``) and raises ImportError if they are
missing or were built for another torch.
"""

import os as _os

import torch as _torch

__version__ = "0.1.0"

from . import extension  # noqa: E402  (build helpers; no kernels needed)
from .extension import include_paths  # noqa: E402

if _os.environ.get("_OPFORGE_TOOLING_ONLY") != "1":
    # The CLI's build-tool commands (cache, doctor, new) must work when the
    # kernels are absent or broken; everything else needs them loaded.
    from . import _loader

    _loader.load()

    from .ops.add import add, add_relu  # noqa: E402
    from .ops.conv import conv2d_3x3  # noqa: E402
    from .ops.nms import batched_nms, nms, nms_padded  # noqa: E402
    from .ops.softmax import log_softmax, scaled_masked_softmax, softmax  # noqa: E402

    from . import nn  # noqa: E402

__all__ = [
    "add",
    "add_relu",
    "softmax",
    "log_softmax",
    "scaled_masked_softmax",
    "nms",
    "batched_nms",
    "nms_padded",
    "conv2d_3x3",
    "nn",
    "include_paths",
    "extension",
    "__version__",
]
