"""What ``opforge bench models`` covers, importable without torch (the ``opforge`` command's
parser reads it, and ``opforge cache path`` must not import torch)."""

MODELS = ("mobilenet_v2", "mobilenet_v3_large", "resnet18", "resnet50")
PROVIDERS = (
    "eager",
    "compile",
    "compile_freezing",
    "optimize",
    "compile_optimize",
    "compile_ro",
    "compile_optimize_ro",
)
