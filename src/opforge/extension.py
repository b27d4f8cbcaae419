"""Build helpers over ``torch.utils.cpp_extension`` with sensible defaults.

opforge builds itself with these helpers (``setup.py`` and :mod:`opforge.jit`),
and so do the projects ``opforge new`` generates. One :class:`SourceSet`
describes an extension once; ``setup_extension`` turns it into a setuptools
extension for an installed build and ``jit_load`` compiles the same sources
into the torch extensions cache.

This module must import without the compiled opforge kernels (``setup.py``
loads it by path before anything is built), so it depends on torch only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import os
import re
import shutil
import sys
from pathlib import Path

DEFAULT_CUDA_ARCHS = "8.0;8.6;8.9;9.0+PTX"

# Where this package's public C++ headers live (``#include <opforge/checks.h>``).
_INCLUDE_DIR = Path(__file__).resolve().parent / "include"


def include_paths() -> list[str]:
    """Include folders for opforge's public C++ helpers.

    Add them to an extension's ``include_dirs`` to use ``<opforge/checks.h>``,
    ``<opforge/dispatch.h>``, ``<opforge/cpu_loops.h>`` and the CUDA helpers.
    """
    return [str(_INCLUDE_DIR)]


def _env_flag(name: str) -> bool | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name} must be 0 or 1, got {value!r}")


def find_nvcc() -> str | None:
    """Path of nvcc: $CUDA_HOME/bin, then /usr/local/cuda/bin, then PATH."""
    candidates = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(Path(os.environ[var]) / "bin" / "nvcc")
    candidates.append(Path("/usr/local/cuda/bin/nvcc"))
    on_path = shutil.which("nvcc")
    if on_path:
        candidates.append(Path(on_path))
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    return None


def cuda_home() -> str | None:
    """The CUDA toolkit folder: $CUDA_HOME, or the one holding nvcc."""
    if os.environ.get("CUDA_HOME"):
        return os.environ["CUDA_HOME"]
    nvcc = find_nvcc()
    return str(Path(nvcc).resolve().parent.parent) if nvcc else None


@dataclasses.dataclass(frozen=True)
class CudaDecision:
    enabled: bool
    reason: str


def decide_cuda(env_var: str = "OPFORGE_CUDA", require_gpu: bool = False) -> CudaDecision:
    """Whether to build CUDA kernels, and why.

    ``env_var`` = 1 forces CUDA (and fails loudly if it cannot be built),
    0 turns it off; unset builds CUDA when the installed torch has CUDA and
    nvcc is found. With ``require_gpu`` (the default of JIT builds in
    projects made by ``opforge new``) an unset ``env_var`` also needs a
    visible GPU: a CPU-only machine then builds the CPU kernels only, which
    takes seconds instead of minutes.
    """
    import torch

    forced = _env_flag(env_var)
    nvcc = find_nvcc()
    if forced is False:
        return CudaDecision(False, f"{env_var}=0")
    if require_gpu and forced is None and not torch.cuda.is_available():
        return CudaDecision(False, f"no GPU visible (set {env_var}=1 to build the CUDA kernels anyway)")
    if torch.version.cuda is None:
        if forced:
            raise RuntimeError(f"{env_var}=1 but the installed torch {torch.__version__} has no CUDA support")
        return CudaDecision(False, f"torch {torch.__version__} is a CPU-only build")
    if nvcc is None:
        if forced:
            raise RuntimeError(f"{env_var}=1 but nvcc was not found (set CUDA_HOME or put nvcc on PATH)")
        return CudaDecision(False, "nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    return CudaDecision(True, f"nvcc at {nvcc}")


def cuda_arch_list(local_default: bool = False) -> str:
    """The arch list to build for: ``TORCH_CUDA_ARCH_LIST`` or the default.

    ``TORCH_CUDA_ARCH_LIST=native`` builds only for the GPUs of this machine.
    With ``local_default`` (JIT builds) an unset ``TORCH_CUDA_ARCH_LIST``
    means ``native`` when a GPU is visible: a build that only ever runs here
    need not compile for every other GPU generation.
    """
    value = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if not value and local_default:
        import torch

        if torch.cuda.is_available():
            value = "native"
    if value.lower() == "native":
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("TORCH_CUDA_ARCH_LIST=native needs a visible GPU")
        caps = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
        value = ";".join(f"{a}.{b}" for a, b in caps)
    return value or DEFAULT_CUDA_ARCHS


def _prepare_cuda_env(local_default: bool = False) -> None:
    # cpp_extension reads these globals; set them before it is imported.
    os.environ["TORCH_CUDA_ARCH_LIST"] = cuda_arch_list(local_default)
    home = cuda_home()
    if home:
        os.environ["CUDA_HOME"] = home
        if "torch.utils.cpp_extension" in sys.modules:
            # It reads CUDA_HOME once, at import, and may have guessed another.
            sys.modules["torch.utils.cpp_extension"].CUDA_HOME = home


def _wheel_cuda_dirs() -> tuple[list[str], list[str]]:
    """CUDA headers and libraries shipped in the nvidia-* wheels torch depends on.

    A bare nvcc install (no toolkit headers such as cusparse.h) builds against
    these; they are added only when they exist.
    """
    includes, libs = [], []
    for site in map(Path, sys.path):
        for sub in ("nvidia/cu13", "nvidia/cuda_runtime"):
            root = site / sub
            if (root / "include").is_dir() and str(root / "include") not in includes:
                includes.append(str(root / "include"))
            if (root / "lib").is_dir() and str(root / "lib") not in libs:
                libs.append(str(root / "lib"))
    return includes, libs


# Folders of compiler-named links to ccache ("masquerade" folders), as the
# distributions install them.
CCACHE_DIRS = ("/usr/lib/ccache", "/usr/lib64/ccache", "/usr/local/lib/ccache", "/opt/homebrew/opt/ccache/libexec")


def enable_ccache(env=None, dirs=CCACHE_DIRS) -> str | None:
    """Route C++ (and nvcc) compiles through ccache when it is installed.

    A rebuild after ``rm -rf`` of a build folder, a fresh virtualenv or a
    branch switch then takes seconds. The C++ compiler is reached through
    ccache's masquerade folder put first on ``PATH``: ``c++`` stays the same
    gcc, so torch's compiler and ABI checks see what they expect (setting
    ``CXX="ccache g++"`` would break them). nvcc goes through
    ``PYTORCH_NVCC``, which torch's ninja build honours. ``OPFORGE_CCACHE=0``
    turns it off. Returns what was enabled, or None.
    """
    env = os.environ if env is None else env
    if _env_flag_in(env, "OPFORGE_CCACHE") is False:
        return None
    ccache = shutil.which("ccache", path=env.get("PATH"))
    if ccache is None:
        return None
    enabled = []
    path = env.get("PATH", "").split(os.pathsep)
    for d in dirs:
        if any(os.access(os.path.join(d, cc), os.X_OK) for cc in ("c++", "g++")):
            if d not in path[:1]:
                env["PATH"] = os.pathsep.join([d] + [p for p in path if p != d])
            enabled.append(f"c++ via {d}")
            break
    nvcc = find_nvcc()
    if nvcc and "PYTORCH_NVCC" not in env:
        env["PYTORCH_NVCC"] = f"{ccache} {nvcc}"
        enabled.append("nvcc")
    return ", ".join(enabled) or None


def _env_flag_in(env, name: str) -> bool | None:
    value = env.get(name)
    if value is None or value == "":
        return None
    return value.lower() not in ("0", "false", "no", "off")


def max_jobs() -> int:
    """Parallel compile jobs: ``MAX_JOBS`` or the number of cores."""
    value = os.environ.get("MAX_JOBS")
    if value:
        return max(1, int(value))
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def _arch_define(arch_list: str) -> str:
    # "8.0;9.0+PTX" -> "80_90+PTX": safe in a shell, in ninja and through
    # nvcc (which splits option values at commas); stringified in C++.
    return "_".join(a.strip().replace(".", "") for a in re.split(r"[;\s]+", arch_list) if a.strip())


class _DropNoRuntime(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("No CUDA runtime is found")


def import_cpp_extension():
    """``torch.utils.cpp_extension``, imported with CUDA_HOME set to
    :func:`cuda_home` for the import (so torch's guess is never made) and
    without its "No CUDA runtime is found" record: a missing GPU is reported
    where it matters (``opforge doctor``, ``opforge info``)."""
    module = sys.modules.get("torch.utils.cpp_extension")
    if module is not None:
        return module
    saved = os.environ.get("CUDA_HOME")
    home = cuda_home()
    if home:
        os.environ["CUDA_HOME"] = home
    logger = logging.getLogger("torch.utils.cpp_extension")
    quiet = _DropNoRuntime()
    logger.addFilter(quiet)
    try:
        from torch.utils import cpp_extension
    finally:
        logger.removeFilter(quiet)
        if saved is None:  # the user's environment is left as it was (doctor reports on it)
            os.environ.pop("CUDA_HOME", None)
        else:
            os.environ["CUDA_HOME"] = saved
    return cpp_extension


def _torch_defines_limited_api() -> bool:
    cpp_extension = import_cpp_extension()

    return "-DPy_LIMITED_API=" in Path(cpp_extension.__file__).read_text()


def openmp_flags() -> tuple[list[str], list[str]]:
    """Compile and link flags that make ``at::parallel_for`` parallel.

    ATen's parallel_for is an inline OpenMP loop when torch is built with
    OpenMP (Linux wheels): without -fopenmp the pragma is ignored and every
    "parallel" CPU kernel runs on one thread. The extension then links
    libgomp.so.1, which resolves to the copy torch already loaded.
    """
    import torch

    if sys.platform.startswith("linux") and "OpenMP" in torch.__config__.parallel_info():
        return ["-fopenmp"], ["-fopenmp"]
    return [], []


@dataclasses.dataclass
class SourceSet:
    """Everything needed to build one extension, for setup.py and JIT alike.

    ``root`` is the folder the source paths are relative to. ``cuda_sources``
    are compiled only when CUDA is enabled, and add ``-DOPFORGE_WITH_CUDA=1``
    to every compile so the C++ side knows what was built.
    """

    name: str
    root: Path
    cpu_sources: list[str]
    cuda_sources: list[str] = dataclasses.field(default_factory=list)
    include_dirs: list[str] = dataclasses.field(default_factory=list)
    cxx_flags: list[str] = dataclasses.field(default_factory=list)
    nvcc_flags: list[str] = dataclasses.field(default_factory=list)
    cuda_env_var: str = "OPFORGE_CUDA"
    # The file that defines this SourceSet (a project's _build.py), named in
    # the error when a listed source is missing.
    defined_in: str | None = None

    def sources(self, with_cuda: bool) -> list[str]:
        files = list(self.cpu_sources) + (list(self.cuda_sources) if with_cuda else [])
        self.check_sources_exist()
        # The JIT build puts every object file in one folder, named after the
        # source's file name: two sources called add.cpp would collide.
        seen: dict[str, str] = {}
        for f in files:
            obj = Path(f).name.replace(".cu", ".cuda")
            if obj in seen:
                raise ValueError(f"{self.name}: sources {seen[obj]} and {f} share a file name; rename one")
            seen[obj] = f
        return [str(Path(self.root) / f) for f in files]

    def check_sources_exist(self) -> None:
        """Raise BuildError naming each listed source that does not exist and
        its list (a file renamed or removed but still listed): without this,
        the compiler's "No such file" or a raw FileNotFoundError is all one
        gets. CUDA sources are checked on a CPU-only build too, so the mistake
        shows where it is made, not first on a GPU machine."""
        lists = [("cpu_sources", self.cpu_sources), ("cuda_sources", self.cuda_sources)]
        missing = [(f, field) for field, files in lists for f in files if not (Path(self.root) / f).is_file()]
        if missing:
            where = f" of {self.defined_in}" if self.defined_in else ""
            lines = [f"  {f} (in {field}{where}): no file {Path(self.root) / f}" for f, field in missing]
            raise BuildError(
                f"{self.name}: {len(missing)} listed source(s) do not exist; fix the list or restore the file:\n"
                + "\n".join(lines)
            )

    def all_files(self) -> list[Path]:
        """Every source and header under the source folders (for change detection)."""
        out = []
        for folder in {Path(self.root) / Path(s).parts[0] for s in self.cpu_sources + self.cuda_sources}:
            base = folder if folder.is_dir() else folder.parent
            out += [p for p in base.rglob("*") if p.suffix in (".h", ".cuh", ".cpp", ".cu")]
        return sorted(set(out))

    def flags(self, with_cuda: bool, for_wheel: bool) -> tuple[list[str], list[str]]:
        import torch

        major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
        defines = [f"-DOPFORGE_TORCH_MAJOR={major}", f"-DOPFORGE_TORCH_MINOR={minor}"]
        if with_cuda:
            cuda_major, cuda_minor = (int(x) for x in torch.version.cuda.split(".")[:2])
            defines += [
                "-DOPFORGE_WITH_CUDA=1",
                f"-DOPFORGE_CUDA_VERSION={cuda_major * 100 + cuda_minor}",
                f"-DOPFORGE_CUDA_ARCHS={_arch_define(cuda_arch_list())}",
            ]
        if for_wheel and not _torch_defines_limited_api():
            # No Python object crosses the boundary (no pybind11), so the
            # module can be built against the stable ABI: one wheel for all
            # Pythons >= 3.10. Newer torch adds this define itself.
            defines += ["-DPy_LIMITED_API=0x030a0000"]
        # The warnings silenced here fire inside torch's and gcc's own headers.
        cxx = (
            ["-O3", "-fdiagnostics-color=always", "-Wno-unknown-pragmas", "-Wno-psabi", "-Wno-maybe-uninitialized"]
            + defines
            + self.cxx_flags
        )
        cxx += openmp_flags()[0]  # C++ only: nvcc's host pass needs no OpenMP
        if os.environ.get("OPFORGE_CPU_NATIVE") == "1":
            # Builds for the CPU of this machine only (edge devices building
            # for themselves): wider vectors for at::vec.
            cxx.append("-march=native")
        nvcc = ["-O3", "-lineinfo", "--expt-relaxed-constexpr"] + defines + self.nvcc_flags
        if os.environ.get("OPFORGE_PTXAS_VERBOSE") == "1":
            # Registers and spills of every kernel in the build's output
            # (read back by `opforge ptxas --log`).
            nvcc += ["-Xptxas", "-v"]
        return cxx, nvcc

    def all_include_dirs(self, with_cuda: bool) -> list[str]:
        dirs = [str(Path(self.root) / d) for d in self.include_dirs] + include_paths()
        if with_cuda:
            dirs += _wheel_cuda_dirs()[0]
        return dirs


def link_flags() -> list[str]:
    """OpenMP's, and no host debug information in the library: Python's own
    CFLAGS (which setuptools passes) carry -g, and its DWARF made 94% of the
    kernel library's size. CUDA's -lineinfo lives in the fatbinary and stays."""
    return openmp_flags()[1] + ["-Wl,--strip-debug"]


def setup_extension(src: SourceSet, module_name: str):
    """A setuptools extension for an installed (abi3) build of ``src``.

    Prints one line saying whether CUDA kernels are built and why.
    """
    decision = decide_cuda(src.cuda_env_var)
    if decision.enabled:
        _prepare_cuda_env()
    cached = enable_ccache()
    if cached:
        print(f"{src.name}: compiling through ccache ({cached})", file=sys.stderr)
    cpp_extension = import_cpp_extension()

    cxx, nvcc = src.flags(decision.enabled, for_wheel=True)
    kind = cpp_extension.CUDAExtension if decision.enabled else cpp_extension.CppExtension
    if decision.enabled:
        print(f"{src.name}: building CPU and CUDA kernels for {cuda_arch_list()} ({decision.reason})", file=sys.stderr)
    else:
        print(f"{src.name}: building CPU kernels only: {decision.reason}", file=sys.stderr)
    os.environ.setdefault("MAX_JOBS", str(max_jobs()))
    library_dirs = _wheel_cuda_dirs()[1] if decision.enabled else []
    # setuptools wants source paths relative to setup.py's folder.
    here = Path.cwd()
    sources = [os.path.relpath(p, here) for p in src.sources(decision.enabled)]
    # Headers too: setuptools skips the build when no listed file is newer than the module.
    depends = [os.path.relpath(p, here) for p in src.all_files()]
    return kind(
        module_name,
        sources,
        depends=depends,
        include_dirs=src.all_include_dirs(decision.enabled),
        library_dirs=library_dirs,
        extra_compile_args={"cxx": cxx, "nvcc": nvcc},
        extra_link_args=link_flags(),
        py_limited_api=True,
    )


# --------------------------------------------------------------------------- JIT


class BuildError(RuntimeError):
    """A build failed (the message starts with the compiler's first error) or
    cannot start (a listed source does not exist: the message names it and its list)."""


def jit_build_directory(name: str) -> Path:
    """Where ``jit_load`` builds ``name``: under ``TORCH_EXTENSIONS_DIR`` or torch's default root."""
    cpp_extension = import_cpp_extension()

    return Path(cpp_extension._get_build_directory(name, verbose=False))


@contextlib.contextmanager
def _build_lock(build_dir: Path, verbose: bool):
    """Serialise builds of one extension and clear a stale torch lock file.

    Older torch releases guard the build folder with a plain ``lock`` file:
    a build killed half-way leaves it behind and every later ``load`` waits
    on it forever. We hold a kernel-level ``flock`` (released by the OS when
    its holder dies, so it never goes stale) around every build; whoever owns
    it knows that a ``lock`` file still lying there belongs to a dead build.
    """
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "opforge.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = build_dir / "lock"
            if stale.exists() and not _torch_uses_kernel_lock():
                print(f"opforge.jit: removing a stale lock left by an interrupted build: {stale}", file=sys.stderr)
                stale.unlink()
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _torch_uses_kernel_lock() -> bool:
    # torch >= 2.14 takes an OS-level FileLock on the same path; its file
    # may stay behind harmlessly and must not be removed while held.
    cpp_extension = import_cpp_extension()

    return hasattr(cpp_extension, "FileLock")


# "file.cpp:12:5: error: ..." (gcc/clang), "file.cu(12): error: ..." (nvcc).
_LOCATED_ERROR = re.compile(r"(\S+:\d+(:\d+)?: (fatal )?error\b|\S+\(\d+\): (catastrophic )?error\b)")


def _compiler_error(log: str) -> tuple[str, str]:
    """The first line that reports an error (one with file:line when there
    is one), and the log's last 80 lines."""
    lines = [re.sub(r"\x1b\[[0-9;]*[mK]", "", ln) for ln in log.splitlines()]  # drop colour codes
    located = [ln for ln in lines if _LOCATED_ERROR.search(ln)]
    keep = located or [ln for ln in lines if re.search(r"(error|Error|undefined reference|undefined symbol|fatal)", ln)]
    first = keep[0] if keep else ""
    return first, "\n".join(lines[-80:])


def jit_load(src: SourceSet, *, verbose: bool = False, with_cuda: bool | None = None, require_gpu: bool = False) -> str:
    """Compile ``src`` into the torch extensions cache and load it.

    Rebuilds only what changed (ninja tracks sources and headers). Returns
    the loaded library's path. On failure raises :class:`BuildError` whose
    message starts with the first compiler error (file:line) and ends with
    the tail of the compiler's output; ``verbose`` also prints every command.

    ``with_cuda`` None decides by :func:`decide_cuda` (``require_gpu`` is
    passed on). CUDA JIT builds target the visible GPUs when
    ``TORCH_CUDA_ARCH_LIST`` is unset. ccache is used when installed.
    """
    import io

    cpp_extension = import_cpp_extension()

    if with_cuda is None:
        decision = decide_cuda(src.cuda_env_var, require_gpu=require_gpu)
        with_cuda = decision.enabled
    if with_cuda:
        _prepare_cuda_env(local_default=True)
    enable_ccache()
    cxx, nvcc = src.flags(with_cuda, for_wheel=False)
    build_dir = jit_build_directory(src.name)
    os.environ.setdefault("MAX_JOBS", str(max_jobs()))
    extra_ldflags = ([f"-L{d}" for d in _wheel_cuda_dirs()[1]] if with_cuda else []) + link_flags()
    kwargs = dict(
        name=src.name,
        sources=src.sources(with_cuda),
        extra_cflags=cxx,
        extra_cuda_cflags=nvcc,
        extra_ldflags=extra_ldflags,
        extra_include_paths=src.all_include_dirs(with_cuda),
        build_directory=str(build_dir),
        with_cuda=with_cuda,
        is_python_module=False,
        verbose=verbose,  # torch prints every command line when verbose
    )
    with _build_lock(build_dir, verbose):
        capture = io.StringIO()
        quiet = contextlib.nullcontext() if verbose else contextlib.redirect_stdout(capture)
        try:
            with quiet:
                cpp_extension.load(**kwargs)
        except RuntimeError as exc:
            first, tail = _compiler_error(str(exc) + "\n" + capture.getvalue())
            raise BuildError(
                f"building {src.name} failed in {build_dir}\n"
                f"first error: {first.strip()}\n--- compiler output (tail) ---\n{tail}"
            ) from None
    libs = sorted(build_dir.glob(f"{src.name}*.so"), key=lambda p: p.stat().st_mtime)
    return str(libs[-1]) if libs else str(build_dir)
