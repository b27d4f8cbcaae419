"""One module per op family: the Python wrapper, its fake kernel and its autograd."""

from .. import _loader

# Each module registers fake kernels and autograd against the compiled schemas,
# so the kernels load first (an ImportError saying how to build them if missing).
_loader.load()
