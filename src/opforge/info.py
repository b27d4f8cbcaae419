"""``opforge info``: what is installed, what was built, what is registered."""

from __future__ import annotations

import os
import platform

import torch


def registered_ops() -> list[str]:
    names = torch._C._dispatch_get_all_op_names()
    return sorted(n.split("::", 1)[1] for n in names if n.startswith("opforge::"))


def _bench_families() -> str:
    try:
        from .bench.registry import families

        return ", ".join(sorted(families())) or "none"
    except Exception as exc:  # noqa: BLE001  (a broken bench module must not break `info`)
        return f"unavailable ({type(exc).__name__}: {exc})"


def _gpu_lines() -> list[str]:
    if not torch.cuda.is_available():
        return ["GPU          none visible" + (" (torch built without CUDA)" if torch.version.cuda is None else "")]
    lines = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        l2 = getattr(p, "L2_cache_size", 0)
        extra = f", L2 {l2 >> 20} MiB" if l2 else ""
        lines.append(
            f"GPU {i}        {p.name} (sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, "
            f"{p.total_memory / 2**30:.0f} GiB{extra})"
        )
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    lines.append(f"CUDA runtime {torch.version.cuda}" + (f", cuDNN {cudnn}" if cudnn else ""))
    return lines


def _peers() -> str:
    try:
        import torchvision

        return f"torchvision {torchvision.__version__}"
    except Exception:  # noqa: BLE001
        return "none (torchvision not installed)"


def report() -> str:
    import opforge

    from . import _loader, jit
    from .bench.report import _cpu_model

    _loader.load()  # every line below but python's needs the kernels; a missing build is an ImportError
    built = _loader.build_info()
    isa = built.get("cpu_isa") or torch.backends.cpu.get_cpu_capability()
    cuda_kernels = (
        "built for CUDA " + built["cuda"] + ", archs " + built["archs"] if built["cuda"] != "none" else "not built"
    )
    lines = [
        f"opforge      {opforge.__version__} ({_loader.source})",
        f"torch        {torch.__version__} (kernels built for torch {built['torch']})",
        f"python       {platform.python_version()}",
        f"CUDA kernels {cuda_kernels}",
        f"CPU kernels  {isa} (the best instruction set compiled in, picked at run time)",
        f"ops          {', '.join(registered_ops())}",
        f"bench cases  {_bench_families()}",
        f"peers        {_peers()}",
        f"JIT cache    {jit.cache_dir()}",
        f"CPU          {_cpu_model()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads",
    ]
    lines += _gpu_lines()
    return "\n".join(lines)
