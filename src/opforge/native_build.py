"""Building C++ programs against the installed torch wheel's libtorch (no Python linked).

Used by the C++ test program (tests/test_cpp_api.py) and the deployment
runner (``opforge deploy --runner``): one translation unit compiled with the
system's C++ compiler, torch's include paths and ABI flag, linked with
libtorch's libraries and, where asked, opforge's kernel library. Builds are
cached in a folder keyed on the sources and the command lines, so an
unchanged program is never recompiled; a build is moved into place whole.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from . import extension


class BuildError(RuntimeError):
    """A compile or link step failed; the message holds the command and the compiler's output."""


def torch_library_dir() -> str:
    return extension.import_cpp_extension().library_paths()[0]


def compile_command(source: Path, obj: Path, opt: str = "-O1") -> list[str]:
    import torch

    from . import include_paths

    cpp_extension = extension.import_cpp_extension()
    includes = [f"-I{p}" for p in cpp_extension.include_paths() + include_paths()]
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    return [shutil.which("c++") or "g++", "-std=c++20", opt, abi, *includes, "-c", str(source), "-o", str(obj)]


def link_command(obj: Path, out: Path, libraries: Sequence[str], link_library: str | None = None) -> list[str]:
    """Links ``obj`` with libtorch's ``libraries`` (e.g. ``torch_cpu``, ``c10``) and, when
    given, opforge's kernel library: kept with --no-as-needed, since a program calls its
    ops through the dispatcher and references none of its symbols."""
    lib = torch_library_dir()
    cmd = [shutil.which("c++") or "g++", str(obj), "-o", str(out), f"-L{lib}", f"-Wl,-rpath,{lib}"]
    # Libraries loaded at start-up, also those nothing references directly
    # (libtorch.so: a package loaded later by dlopen names it).
    cmd.append("-Wl,--no-as-needed")
    cmd += [f"-l{name}" for name in libraries]
    if link_library is not None:
        cmd += [link_library, f"-Wl,-rpath,{Path(link_library).parent}"]
    return cmd + ["-Wl,--as-needed"]


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise BuildError(f"{' '.join(cmd)}\n{proc.stdout}{proc.stderr}")


def build_programs(
    source: Path,
    cache: Path,
    variants: dict[str, tuple[Sequence[str], str | None]],
    extra_inputs: Sequence[Path] = (),
) -> dict[str, Path]:
    """``source`` compiled once and linked per variant: name -> (libtorch libraries, kernel
    library or None). Returns name -> program path; cached under ``cache``."""
    key = hashlib.sha256()
    commands = [compile_command(source, Path("x.o"))]
    commands += [link_command(Path("x.o"), Path(n), libs, lib) for n, (libs, lib) in sorted(variants.items())]
    for part in [p.read_bytes() for p in [source, *extra_inputs]] + [repr(commands).encode()]:
        key.update(part)
    out = cache / key.hexdigest()[:16]
    programs = {name: out / name for name in variants}
    if all(p.exists() for p in programs.values()):
        return programs
    for old in cache.glob("*"):  # older keys: nothing reuses them (builds in flight are left alone)
        if ".tmp" not in old.name:
            shutil.rmtree(old, ignore_errors=True)
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    obj = tmp / f"{source.stem}.o"
    _run(compile_command(source, obj))
    for name, (libs, lib) in variants.items():
        _run(link_command(obj, tmp / name, libs, lib))
    obj.unlink()
    try:
        os.replace(tmp, out)  # whole or not at all, should two runs build at once
    except OSError:  # another run was first: its programs are the same
        shutil.rmtree(tmp, ignore_errors=True)
    return programs


def run_env() -> dict[str, str]:
    """The environment to run a built program in: libtorch's folder on the loader's path,
    so the kernel library's own libtorch dependencies (libtorch_cuda) are found."""
    paths = [torch_library_dir(), os.environ.get("LD_LIBRARY_PATH")]
    return {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join(p for p in paths if p)}
