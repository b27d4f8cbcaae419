"""Facts about the machine a run measures on: caches, allocator, load, environment."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path

import torch


def last_level_cache_bytes(device: str) -> int:
    """L2 on the GPU; the largest CPU cache in /sys (64 MiB if unreadable).

    ``OPFORGE_BENCH_CACHE_BYTES`` overrides it (e.g. a VM that under-reports its cache).
    """
    if os.environ.get("OPFORGE_BENCH_CACHE_BYTES"):
        return int(os.environ["OPFORGE_BENCH_CACHE_BYTES"])
    if device == "cuda":
        size = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", 0)
        return int(size) or (60 << 20)
    best = 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        value = int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)
        best = max(best, value)
    return best or (64 << 20)


def steady_cpu_allocator() -> bool:
    """Keep freed CPU memory in the process heap for the rest of the run.

    glibc returns large blocks (32 MiB and up, and smaller ones until its
    adaptive threshold has risen) to the OS on free, so the next allocation
    of that size page-faults its way through fresh zeroed pages: ~10 ms for
    32 MiB here, more than the kernel being timed. Whether a provider pays it
    depends on what ran before it, which made the comparison unfair. With
    mmap and trimming off, every provider reuses heap memory for its outputs,
    as a process in a steady training or inference loop does. Linux/glibc
    only; returns whether it applied.
    """
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    ok = libc.mallopt(M_MMAP_THRESHOLD, 1 << 30) == 1
    ok &= libc.mallopt(M_TRIM_THRESHOLD, (1 << 31) - 1) == 1
    return bool(ok)


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit() -> str | None:
    """The source tree's commit (with ``-dirty`` if it has changes), if it is a git checkout.

    ``OPFORGE_SOURCE_COMMIT`` names it instead, for a tree copied to another
    machine without (or with stale) git metadata.
    """
    named = os.environ.get("OPFORGE_SOURCE_COMMIT", "").strip()
    if named:
        return named
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=here,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("-dirty" if dirty else "") if commit else None


def cpu_isa() -> str:
    """The instruction set opforge's CPU kernels run with (as reported by the library)."""
    from .. import _loader

    try:
        isa = _loader.build_info().get("cpu_isa")
    except Exception:  # noqa: BLE001  (kernels not loaded)
        isa = None
    return isa or torch.backends.cpu.get_cpu_capability()


def environment(device: str, load_at_start: float | None = None) -> dict:
    """The run's environment, taken at its end (``load_at_start``: the load average when it began)."""
    import opforge

    env = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "device": device,
        "opforge": opforge.__version__,
        "git_commit": git_commit(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "usable_cores": usable_cores(),
        "torch_threads": torch.get_num_threads(),
        "cpu_isa": cpu_isa(),
        "load_avg_1m_start": load_at_start,
        "load_avg_1m": load_average(),
        "gpu": None,
    }
    try:
        import torchvision

        env["torchvision"] = torchvision.__version__
    except Exception:  # noqa: BLE001
        env["torchvision"] = None
    if device == "cuda":
        p = torch.cuda.get_device_properties(torch.cuda.current_device())
        env["gpu"] = p.name
        env["gpu_sm"] = f"sm_{p.major}{p.minor}"
        env["gpu_sms"] = p.multi_processor_count
        env["gpu_memory_gib"] = round(p.total_memory / 2**30, 1)
        env["gpu_driver"] = _driver_version()
        env["gpu_l2_bytes"] = getattr(p, "L2_cache_size", None)
    return env


def usable_cores() -> int | None:
    """The cores this process may run on (its affinity mask; a container or taskset can narrow it)."""
    try:
        return len(os.sched_getaffinity(0))
    except (OSError, AttributeError):  # not on Linux
        return os.cpu_count()


def load_average() -> float | None:
    """The 1-minute load average now (runnable tasks, this run's threads included)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


def _driver_version() -> str | None:
    """The NVIDIA driver's version from nvidia-smi, if it is on the PATH."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    return out[0] if out else None
