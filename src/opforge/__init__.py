"""opforge: fast fused PyTorch operators in C++ (CPU) and CUDA (GPU).

Every op is a real torch op in the ``opforge`` namespace
(``torch.ops.opforge.add_relu``) with autograd, fake kernels for
``torch.compile``, and float32/float64/float16/bfloat16 support::

    import torch, opforge
    y = opforge.add_relu(x, bias)        # relu(x + bias) in one kernel

The compiled kernels (the installed ``opforge._C``, or a JIT build with
``OPFORGE_JIT=1``) are loaded by ``import opforge`` when torch is already
imported, as above, and otherwise by the first use of an op, ``opforge.nn``
or ``opforge.ops``. Either raises ImportError if they are missing or were
built for another torch. The build tools (``opforge.extension``, the
``opforge`` command's ``cache``, ``doctor``, ``new`` and ``ptxas``) need no
kernels and do not import torch until they use it.
"""

import importlib as _importlib
import sys as _sys

__version__ = "0.1.0"

from . import extension  # noqa: E402  (build helpers; no kernels, no torch at import)
from .extension import include_paths  # noqa: E402

# The public ops, bound by _load_ops; looking any of them (or nn, ops) up loads the kernels.
_OPS = (
    "add",
    "add_relu",
    "softmax",
    "log_softmax",
    "scaled_masked_softmax",
    "nms",
    "batched_nms",
    "nms_padded",
    "conv2d_3x3",
    "conv2d_1x1",
    "conv2d_batch_norm",
    "batch_norm_act",
    "squeeze_excitation",
)
_NEEDS_KERNELS = frozenset(_OPS) | {"nn", "ops", "optimize"}


def _load_ops() -> None:
    """Load the kernels, then bind every op as a plain module attribute (no
    per-call cost: ``__getattr__`` is never consulted for them again)."""
    from . import _loader

    _loader.load()
    from .ops.add import add, add_relu
    from .ops.conv import conv2d_1x1, conv2d_3x3
    from .ops.conv_batch_norm import batch_norm_act, conv2d_batch_norm
    from .ops.nms import batched_nms, nms, nms_padded
    from .ops.softmax import log_softmax, scaled_masked_softmax, softmax
    from .ops.squeeze_excitation import squeeze_excitation
    from .optimize import optimize

    # Not `from . import nn`: that asks this module's __getattr__ for `nn` first.
    nn = _importlib.import_module(f"{__name__}.nn")
    ops = _importlib.import_module(f"{__name__}.ops")

    globals().update(
        add=add,
        add_relu=add_relu,
        conv2d_3x3=conv2d_3x3,
        conv2d_1x1=conv2d_1x1,
        conv2d_batch_norm=conv2d_batch_norm,
        batch_norm_act=batch_norm_act,
        batched_nms=batched_nms,
        nms=nms,
        nms_padded=nms_padded,
        log_softmax=log_softmax,
        scaled_masked_softmax=scaled_masked_softmax,
        softmax=softmax,
        squeeze_excitation=squeeze_excitation,
        nn=nn,
        ops=ops,
        optimize=optimize,
    )


def __getattr__(name: str):
    if name in _NEEDS_KERNELS:
        _load_ops()
        return globals()[name]
    raise AttributeError(f"module 'opforge' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [*_OPS, "nn", "optimize", "include_paths", "extension", "__version__"]

if "torch" in _sys.modules:
    # torch's import is paid already, so the kernels cost little more, and
    # `torch.ops.opforge.*` works straight after `import torch, opforge`.
    _load_ops()
