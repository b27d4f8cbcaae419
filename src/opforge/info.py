"""``opforge info``: what is installed, what was built, what is registered."""

from __future__ import annotations

import platform

import torch


def registered_ops() -> list[str]:
    names = torch._C._dispatch_get_all_op_names()
    return sorted(n.split("::", 1)[1] for n in names if n.startswith("opforge::"))


def report() -> str:
    import opforge
    from . import _loader, jit

    built = _loader.build_info()
    lines = [
        f"opforge      {opforge.__version__} ({_loader.source})",
        f"torch        {torch.__version__} (kernels built for torch {built['torch']})",
        f"python       {platform.python_version()}",
        f"CUDA kernels {'built for CUDA ' + built['cuda'] + ', archs ' + built['archs'] if built['cuda'] != 'none' else 'not built'}",
        f"ops          {', '.join(registered_ops())}",
        f"JIT cache    {jit.cache_dir()}",
        f"CPU threads  {torch.get_num_threads()} ({platform.processor() or platform.machine()})",
    ]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            lines.append(f"GPU {i}        {p.name} (sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB)")
    else:
        lines.append("GPU          none visible")
    return "\n".join(lines)
