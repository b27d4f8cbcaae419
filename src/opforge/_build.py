"""The one list of opforge's C++/CUDA sources and build flags.

``setup.py`` (installed build) and :mod:`opforge.jit` (JIT build) both read
``SOURCES`` from here, so the two builds can never drift apart. A new op adds
its files to the lists below and nothing else.
"""

from pathlib import Path

try:  # imported as opforge._build
    from . import extension
except ImportError:  # loaded by path from setup.py, before opforge is built
    import importlib.util
    import sys

    _spec = importlib.util.spec_from_file_location("_opforge_extension", Path(__file__).with_name("extension.py"))
    extension = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = extension
    _spec.loader.exec_module(extension)

PACKAGE_DIR = Path(__file__).resolve().parent

SOURCES = extension.SourceSet(
    name="opforge_C",
    root=PACKAGE_DIR,
    cpu_sources=[
        "csrc/module.cpp",
        "csrc/add.cpp",
        "csrc/cpu/add_cpu.cpp",
        "csrc/cpu/add_default.cpp",
        "csrc/cpu/add_avx2.cpp",
        "csrc/cpu/add_avx512.cpp",
        "csrc/nms.cpp",
        "csrc/cpu/nms_cpu.cpp",
        "csrc/cpu/nms_default.cpp",
        "csrc/cpu/nms_avx2.cpp",
        "csrc/cpu/nms_avx512.cpp",
        "csrc/softmax.cpp",
        "csrc/softmax_autograd.cpp",
        "csrc/cpu/softmax_cpu.cpp",
        "csrc/cpu/softmax_default.cpp",
        "csrc/cpu/softmax_avx2.cpp",
        "csrc/cpu/softmax_avx512.cpp",
        "csrc/conv.cpp",
        "csrc/conv_autograd.cpp",
        "csrc/conv_batch_norm.cpp",
        "csrc/batch_norm_act.cpp",
        "csrc/batch_norm_train.cpp",
        "csrc/conv_pointwise.cpp",
        "csrc/cpu/conv_cpu.cpp",
        "csrc/cpu/conv_dense_cpu.cpp",
        "csrc/cpu/conv_default.cpp",
        "csrc/cpu/conv_avx2.cpp",
        "csrc/cpu/conv_avx512.cpp",
        "csrc/cpu/batch_norm_act_cpu.cpp",
        "csrc/cpu/batch_norm_act_default.cpp",
        "csrc/cpu/batch_norm_act_avx2.cpp",
        "csrc/cpu/batch_norm_act_avx512.cpp",
        "csrc/squeeze_excitation.cpp",
        "csrc/bench_noop.cpp",
    ],
    cuda_sources=[
        "csrc/cuda/add.cu",
        "csrc/cuda/nms.cu",
        "csrc/cuda/softmax/softmax_ops.cpp",
        "csrc/cuda/softmax/softmax_plan.cpp",
        "csrc/cuda/softmax/softmax_occupancy.cpp",
        "csrc/cuda/softmax/softmax_fwd_float32.cu",
        "csrc/cuda/softmax/softmax_fwd_float64.cu",
        "csrc/cuda/softmax/softmax_fwd_float16.cu",
        "csrc/cuda/softmax/softmax_fwd_bfloat16.cu",
        "csrc/cuda/softmax/softmax_bwd_float32.cu",
        "csrc/cuda/softmax/softmax_bwd_float64.cu",
        "csrc/cuda/softmax/softmax_bwd_float16.cu",
        "csrc/cuda/softmax/softmax_bwd_bfloat16.cu",
        "csrc/cuda/softmax/softmax_columns.cu",
        "csrc/cuda/conv.cu",
        "csrc/cuda/conv_depthwise/conv_dw.cpp",
        "csrc/cuda/conv_depthwise/conv_dw_plan.cpp",
        "csrc/cuda/conv_depthwise/conv_dw_forward_nchw.cu",
        "csrc/cuda/conv_depthwise/conv_dw_forward_nhwc.cu",
        "csrc/cuda/conv_depthwise/conv_dw_grad_input.cu",
        "csrc/cuda/conv_depthwise/conv_dw_grad_weight.cu",
        "csrc/cuda/conv_depthwise/conv_dw_fused.cu",
        "csrc/cuda/conv_bias_grad.cu",
        "csrc/cuda/conv_dense_mma.cu",
        "csrc/cuda/conv_pointwise_cuda.cpp",
        "csrc/cuda/batch_norm_act.cu",
    ],
    include_dirs=["csrc"],
)


def setup_extension():
    """The setuptools extension ``opforge._C`` for an installed build."""
    return extension.setup_extension(SOURCES, "opforge._C")
