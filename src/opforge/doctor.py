"""``opforge doctor``: is this machine ready to build and run PyTorch extensions?

Checks the toolchain a build needs (C++ compiler and its C++ standard, nvcc
against torch's CUDA, CUDA_HOME and headers, ninja, the C++ ABI flag), the
JIT cache (free disk, stale locks), whether opforge's own kernels load,
whether a GPU is visible, and, run inside a project made by ``opforge new``,
whether that project loads with a kernel for every op and backend built.
Each check prints OK, WARN or FAIL; every WARN and FAIL says what to do. The exit code is 1 when anything FAILed.

It imports nothing that needs opforge's compiled kernels (the kernel check
runs in a subprocess), and torch only for the checks that need it: the first
lines print at once, each line as soon as its check is done.
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from . import _cpp_extension, extension

OK, WARN, FAIL = "OK", "WARN", "FAIL"


@dataclasses.dataclass
class Check:
    name: str
    status: str
    detail: str
    fix: str = ""


def _run(cmd: list[str], stdin: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=timeout)


def _torch_minor() -> tuple[int, int]:
    major, minor = _cpp_extension.torch_version()["__version__"].split("+")[0].split(".")[:2]
    return int(major), int(minor)


def _torch_cuda() -> str | None:
    return _cpp_extension.torch_version()["cuda"]


def required_cxx_standard(torch_version: tuple[int, int] | None = None) -> str:
    """The C++ standard torch compiles extensions with.

    Read from the installed torch's build helpers (newer releases pass
    ``-std=c++20``, older ones ``-std=c++17``); for a given version without
    looking, C++20 from torch 2.10.
    """
    if torch_version is not None:
        return "c++20" if torch_version >= (2, 10) else "c++17"
    return "c++20" if "-std=c++20" in _cpp_extension.cpp_extension_source() else "c++17"


def check_compiler() -> Check:
    cxx = os.environ.get("CXX", "c++")
    path = shutil.which(cxx.split()[0]) if cxx else None
    if path is None:
        return Check(
            "compiler",
            FAIL,
            f"C++ compiler {cxx!r} not found",
            "install g++ (Debian/Ubuntu: apt-get install g++; conda: conda install gxx) or set CXX",
        )
    try:
        version = _run([path, "-dumpfullversion", "-dumpversion"]).stdout.strip() or "?"
        kind = "clang" if "clang" in _run([path, "--version"]).stdout.lower() else "g++"
    except (OSError, subprocess.SubprocessError) as exc:
        return Check(
            "compiler", FAIL, f"{path} does not run: {exc}", "reinstall the compiler or point CXX at a working one"
        )
    std = required_cxx_standard()
    probe = (
        "#include <concepts>\n#include <span>\nint main() { return 0; }\n"
        if std == "c++20"
        else "#include <optional>\nint main() {}\n"
    )
    try:
        proc = _run([path, f"-std={std}", "-fsyntax-only", "-x", "c++", "-"], stdin=probe)
    except (OSError, subprocess.SubprocessError) as exc:
        proc = subprocess.CompletedProcess([], 1, "", str(exc))
    if proc.returncode != 0:
        first = (proc.stderr.strip().splitlines() or ["(no output)"])[0]
        return Check(
            "compiler",
            FAIL,
            f"{kind} {version} at {path} cannot compile {std.upper()}, "
            f"which torch {'.'.join(map(str, _torch_minor()))} needs: {first}",
            "install a newer compiler (g++ >= 10 for C++20) and put it first on PATH or set CXX",
        )
    return Check("compiler", OK, f"{kind} {version} at {path}, {std.upper()} supported")


def nvcc_version(nvcc: str) -> str | None:
    try:
        out = _run([nvcc, "--version"]).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+)\.(\d+)", out)
    return f"{m.group(1)}.{m.group(2)}" if m else None


def compare_cuda(nvcc: str | None, torch_cuda: str | None) -> tuple[str, str, str]:
    """(status, detail, fix) for nvcc's CUDA version against torch's."""
    if torch_cuda is None:
        return OK, "torch is a CPU-only build: no nvcc needed", ""
    if nvcc is None:
        return (
            WARN,
            f"nvcc not found (torch was built with CUDA {torch_cuda}): only CPU kernels can be built",
            (
                f"install the CUDA {torch_cuda.split('.')[0]}.x toolkit "
                "(or a pytorch *-devel container) and set CUDA_HOME"
            ),
        )
    if nvcc.split(".")[0] != torch_cuda.split(".")[0]:
        return (
            FAIL,
            f"nvcc is CUDA {nvcc} but torch was built with CUDA {torch_cuda}: kernels would not load",
            (
                f"install CUDA {torch_cuda.split('.')[0]}.x and point CUDA_HOME at it, "
                f"or install a torch built for CUDA {nvcc.split('.')[0]}"
            ),
        )
    if nvcc != ".".join(torch_cuda.split(".")[:2]):
        return OK, f"nvcc CUDA {nvcc}, torch CUDA {torch_cuda} (same major version: compatible)", ""
    return OK, f"nvcc CUDA {nvcc} matches torch's CUDA {torch_cuda}", ""


def check_nvcc() -> Check:
    nvcc = extension.find_nvcc()
    version = nvcc_version(nvcc) if nvcc else None
    if nvcc and version is None:
        return Check(
            "nvcc", FAIL, f"{nvcc} does not report a version", "check the CUDA installation (run nvcc --version)"
        )
    status, detail, fix = compare_cuda(version, _torch_cuda())
    if nvcc:
        detail += f" [{nvcc}]"
    return Check("nvcc", status, detail, fix)


def check_cuda_home() -> Check:
    env = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if env and not Path(env).is_dir():
        return Check(
            "CUDA_HOME",
            FAIL,
            f"CUDA_HOME={env} does not exist",
            "unset it or point it at the CUDA toolkit (the folder holding bin/nvcc)",
        )
    home = extension.cuda_home()
    if home is None:
        status = OK if _torch_cuda() is None else WARN
        return Check(
            "CUDA_HOME",
            status,
            "not set and no CUDA toolkit found",
            "" if status == OK else "export CUDA_HOME=/usr/local/cuda (the folder holding bin/nvcc)",
        )
    return Check("CUDA_HOME", OK, f"{home}" + ("" if env else " (from nvcc's location)"))


def find_cuda_runtime_header() -> str | None:
    home = extension.cuda_home()
    folders = []
    if home:
        folders += [
            Path(home) / "include",
            Path(home) / "targets" / "x86_64-linux" / "include",
            Path(home) / "targets" / "sbsa-linux" / "include",
        ]
    folders += [Path(d) for d in extension._wheel_cuda_dirs()[0]]
    for folder in folders:
        if (folder / "cuda_runtime.h").is_file():
            return str(folder / "cuda_runtime.h")
    return None


def check_cuda_headers() -> Check:
    if _torch_cuda() is None or extension.find_nvcc() is None:
        return Check("CUDA headers", OK, "not needed (no CUDA build here)")
    found = find_cuda_runtime_header()
    if found is None:
        return Check(
            "CUDA headers",
            FAIL,
            "cuda_runtime.h not found in CUDA_HOME/include nor in the nvidia wheels",
            f"install the CUDA {_torch_cuda()} toolkit headers (cuda-cudart-dev) or `pip install nvidia-cuda-runtime`",
        )
    return Check("CUDA headers", OK, found)


def check_ninja() -> Check:
    ninja = shutil.which("ninja")
    if ninja is None:
        return Check(
            "ninja",
            FAIL,
            "ninja not found: JIT builds and fast installed builds need it",
            "pip install ninja (or apt-get install ninja-build)",
        )
    try:
        version = _run([ninja, "--version"]).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return Check("ninja", FAIL, f"{ninja} does not run: {exc}", "pip install --force-reinstall ninja")
    return Check("ninja", OK, f"{version} at {ninja}")


def check_abi() -> Check:
    import torch

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    for var in ("CXXFLAGS", "CFLAGS", "CPPFLAGS"):
        m = re.search(r"_GLIBCXX_USE_CXX11_ABI=(\d)", os.environ.get(var, ""))
        if m and int(m.group(1)) != abi:
            return Check(
                "C++ ABI",
                FAIL,
                f"{var} sets _GLIBCXX_USE_CXX11_ABI={m.group(1)} but torch uses {abi}: "
                "the build would fail to load with `undefined symbol` errors",
                f"remove -D_GLIBCXX_USE_CXX11_ABI from {var}; torch's build helpers pass the right value",
            )
    return Check(
        "C++ ABI", OK, f"torch uses _GLIBCXX_USE_CXX11_ABI={abi}; extensions built with torch's helpers match it"
    )


def jit_cache_root() -> Path:
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or _cpp_extension.default_build_root())


def check_disk(root: Path | None = None, warn_gib: float = 2.0, fail_gib: float = 0.5) -> Check:
    root = root or jit_cache_root()
    probe = root
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free / 2**30
    detail = f"{free:.1f} GiB free for the JIT cache at {root}"
    fix = (
        "free space on that disk or point TORCH_EXTENSIONS_DIR at a larger one "
        "(opforge cache clear removes opforge's builds)"
    )
    if free < fail_gib:
        return Check("disk", FAIL, detail, fix)
    if free < warn_gib:
        return Check("disk", WARN, detail, fix)
    return Check("disk", OK, detail)


def _lock_is_held(path: Path) -> bool:
    try:
        with open(path, "a") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return True
            fcntl.flock(handle, fcntl.LOCK_UN)
            return False
    except OSError:
        return False


def stale_locks(root: Path | None = None) -> list[Path]:
    """Lock files in the JIT cache that no running build holds.

    torch releases before its OS-level FileLock wait forever on a ``lock``
    file left by a killed build; newer ones use it as an flock and a
    leftover file is harmless. Either way a lock nobody holds is reported
    only where it would block (old torch).
    """
    root = root or jit_cache_root()
    if not root.is_dir():
        return []
    _cpp_extension.import_cpp_extension()  # imported here first: without torch's CUDA_HOME guess
    if extension._torch_uses_kernel_lock():
        return []  # a leftover file is an flock the OS released: it never blocks
    return [lock for lock in sorted(root.glob("*/lock")) if not _lock_is_held(lock)]


def check_jit_cache() -> Check:
    root = jit_cache_root()
    stale = stale_locks(root)
    if stale:
        return Check(
            "JIT cache",
            WARN,
            f"stale lock(s) left by interrupted builds: {', '.join(map(str, stale))}",
            "remove them (rm the listed files) or clear the build: opforge cache clear "
            "(opforge's own JIT builds clear them automatically)",
        )
    return Check("JIT cache", OK, f"{root}, no stale lock")


def check_kernels(timeout: float = 600) -> Check:
    code = (
        "import torch, opforge\n"
        "from opforge import _loader\n"
        "a, b = torch.randn(100), torch.randn(100)\n"
        "assert torch.equal(opforge.add_relu(a, b), torch.relu(a + b)), 'wrong result'\n"
        "print('LOADED', _loader.describe_build())\n"
        "print('CUDA_GAP' if torch.cuda.is_available() and _loader.build_info()['cuda'] == 'none' else '')\n"
    )
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return Check(
            "opforge kernels",
            FAIL,
            f"loading took over {timeout:.0f} s (a JIT build waiting on a lock?)",
            "run `opforge cache clear` and retry; "
            "`OPFORGE_JIT=1 python -c 'import torch, opforge'` runs the build in the foreground",
        )
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        last = lines[-1] if lines else "(no output)"
        return Check(
            "opforge kernels",
            FAIL,
            f"import opforge failed: {last}",
            "build them: `pip install --no-build-isolation -e .` in the opforge source tree, "
            "or set OPFORGE_JIT=1 to compile them at import",
        )
    lines = proc.stdout.strip().splitlines()
    info = next((ln.removeprefix("LOADED ") for ln in lines if ln.startswith("LOADED ")), lines[0] if lines else "")
    if "CUDA_GAP" in lines:
        return Check(
            "opforge kernels",
            WARN,
            f"loaded without CUDA kernels although a GPU is visible: {info}",
            "rebuild with nvcc available: `pip install --no-build-isolation -e .` "
            "(OPFORGE_CUDA=1 makes a missing nvcc an error)",
        )
    return Check("opforge kernels", OK, info)


def check_project():
    """Inside a project made by `opforge new`: its library loads and every op has its kernels."""
    from .doctor_project import check_project as check

    found = check()
    return Check(*found) if found else None


def check_gpu() -> Check:
    import torch

    if torch.version.cuda is None:
        return Check(
            "GPU",
            WARN,
            "torch is a CPU-only build: CPU kernels only",
            "install a CUDA build of torch to use a GPU (pip install torch --index-url https://download.pytorch.org/whl/cu130)",
        )
    if not torch.cuda.is_available():
        return Check(
            "GPU",
            WARN,
            "no GPU visible: CUDA kernels can be built but not run here",
            "in a container pass the GPUs (docker run --gpus all ...); check nvidia-smi and CUDA_VISIBLE_DEVICES",
        )
    names = sorted(
        {
            f"{torch.cuda.get_device_name(i)} (sm_{''.join(map(str, torch.cuda.get_device_capability(i)))})"
            for i in range(torch.cuda.device_count())
        }
    )
    return Check("GPU", OK, f"{torch.cuda.device_count()} visible: {', '.join(names)}")


# Every check in the order it runs; the names align the report's columns.
CHECKS = (
    "compiler",
    "nvcc",
    "cuda_home",
    "cuda_headers",
    "ninja",
    "abi",
    "disk",
    "jit_cache",
    "kernels",
    "gpu",
    "project",
)
_WIDTH = len("opforge kernels")  # the longest check name


def iter_checks(check_kernels_too: bool = True):
    """Runs the checks one by one, yielding each result as soon as it is known."""
    for key in CHECKS:
        if key == "kernels" and not check_kernels_too:
            continue
        fn = globals()[f"check_{key}"]  # looked up at run time: tests replace single checks
        try:
            result = fn()
            if result is not None:  # None: the check does not apply here (project: not inside one)
                yield result
        except Exception as exc:  # a broken check is itself a finding
            yield Check(
                key,
                FAIL,
                f"the check itself failed: {type(exc).__name__}: {exc}",
                "report this; the rest of the checks still ran",
            )


def run_checks(check_kernels_too: bool = True) -> list[Check]:
    return list(iter_checks(check_kernels_too))


def header() -> str:
    """The report's first line; it imports no torch, so it prints at once."""
    from . import __version__

    torch = _cpp_extension.torch_version()
    return (
        f"opforge doctor: opforge {__version__}, torch {torch['__version__']} (CUDA {torch['cuda'] or 'none'}), "
        f"python {sys.version.split()[0]}"
    )


def format_check(c: Check, width: int = _WIDTH) -> list[str]:
    lines = [f"[{c.status:^4}] {c.name:<{width}}  {c.detail}"]
    if c.fix and c.status != OK:
        lines.append(f"{'':7}{'':<{width}}  fix: {c.fix}")
    return lines


def summary(checks: list[Check]) -> str:
    fails = sum(c.status == FAIL for c in checks)
    warns = sum(c.status == WARN for c in checks)
    return f"{fails} failed, {warns} warning(s)" if fails or warns else "all checks passed"


def format_report(checks: list[Check]) -> str:
    width = max([_WIDTH] + [len(c.name) for c in checks])
    return "\n".join([header()] + [ln for c in checks for ln in format_check(c, width)] + [summary(checks)])


def main(check_kernels: bool = True) -> int:
    print(header(), flush=True)
    checks = []
    for check in iter_checks(check_kernels):
        checks.append(check)
        print("\n".join(format_check(check)), flush=True)
    print(summary(checks), flush=True)
    return 1 if any(c.status == FAIL for c in checks) else 0
