"""Build opforge's kernels in place (``src/opforge/_C.abi3.so``), quietly and incrementally.

``make build`` runs this. The object files stay in ``build/``, so a second
run recompiles only what changed (ninja tracks every source and header) and
a run with nothing to do takes seconds. The compiler's output goes to
``build/opforge-build.log``; the terminal shows one progress line per file
(``[3/18] csrc/cpu/add.cpp``), warnings from opforge's own sources, and on a
failure the first error and the log's tail. ``VERBOSE=1`` shows everything.

CUDA kernels: ``OPFORGE_CUDA=1`` builds them, ``0`` skips them; unset, they
are built when a GPU is visible (a CPU-only machine builds in minutes, not
the half hour every GPU architecture takes).
"""

from __future__ import annotations

import fcntl
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUILD = REPO / "build"
LOG = BUILD / "opforge-build.log"
CONFIG = BUILD / "opforge-build-config.txt"

# "[3/18] c++ ... -c /path/csrc/cpu/add.cpp -o ..." (ninja -v) -> the source.
_STEP = re.compile(r"^\[(\d+)/(\d+)\]\s.*\s(\S+\.(?:cpp|cu|cc|c))\s+-o\s")
_LINK_STEP = re.compile(r"^\[(\d+)/(\d+)\]\s")
# "file:12:5: warning: ..." (gcc) and "file(12): warning #177-D: ..." (nvcc).
_WARNING = re.compile(r"^(\S+?)(:\d+:\d+:|\(\d+\):) warning\b")


def _cuda_setting() -> str:
    value = os.environ.get("OPFORGE_CUDA", "")
    if value:
        return value
    import torch

    return "1" if torch.version.cuda and torch.cuda.is_available() else "0"


def _config(cuda: str) -> str:
    keys = ("TORCH_CUDA_ARCH_LIST", "OPFORGE_CPU_NATIVE", "OPFORGE_PTXAS_VERBOSE")
    lines = [f"OPFORGE_CUDA={cuda}"] + [f"{k}={os.environ.get(k, '')}" for k in keys]
    return "\n".join(lines) + "\n"


def _short(path: str) -> str:
    try:
        return str(Path(path).resolve().relative_to(REPO / "src" / "opforge"))
    except ValueError:
        return path


def _own_source(path: str) -> bool:
    p = Path(path)
    p = p if p.is_absolute() else (REPO / p)
    return str(p.resolve()).startswith(str(REPO / "src"))


def _run(cmd: list[str], env: dict[str, str], verbose: bool) -> tuple[int, list[str]]:
    """Runs the build, printing progress; returns its exit code and output lines."""
    lines: list[str] = []
    own_warnings = 0
    with (
        subprocess.Popen(
            cmd,
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            errors="replace",
        ) as proc,
        open(LOG, "w") as log,
    ):
        show_context = 0
        for line in proc.stdout:
            log.write(line)
            lines.append(line.rstrip("\n"))
            if verbose:
                sys.stdout.write(line)
                continue
            plain = re.sub(r"\x1b\[[0-9;]*[mK]", "", line.rstrip("\n"))
            step = _STEP.match(plain)
            if step:
                print(f"  [{step[1]}/{step[2]}] {_short(step[3])}", flush=True)
                show_context = 0
                continue
            if _LINK_STEP.match(plain):
                print(f"  [{plain[1:].split(']')[0]}] linking", flush=True)
                continue
            warning = _WARNING.match(plain)
            if warning:
                show_context = 0
                if _own_source(warning[1]):
                    own_warnings += 1
                    show_context = 3
                    print("  " + plain, flush=True)
                continue
            if show_context:
                show_context -= 1
                print("  " + plain, flush=True)
        code = proc.wait()
    if own_warnings:
        print(f"  {own_warnings} warning(s) in opforge's sources (full log: {LOG.relative_to(REPO)})")
    return code, lines


def _extension_helpers():
    # Loaded by path, as setup.py does: the package cannot be imported before it is built.
    import importlib.util

    spec = importlib.util.spec_from_file_location("_opforge_extension", REPO / "src" / "opforge" / "extension.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def main() -> int:
    BUILD.mkdir(exist_ok=True)
    verbose = os.environ.get("VERBOSE", "") not in ("", "0")
    with open(BUILD / ".build.lock", "w") as lock:
        # One build at a time: a second one waits here instead of racing ninja.
        fcntl.flock(lock, fcntl.LOCK_EX)
        cuda = _cuda_setting()
        config = _config(cuda)
        changed = not CONFIG.exists() or CONFIG.read_text() != config
        env = {**os.environ, "OPFORGE_CUDA": cuda}
        cmd = [sys.executable, "setup.py", "build_ext", "--inplace"] + (["--force"] if changed else [])
        if not verbose:
            cmd.insert(2, "-q")
        what = "CPU and CUDA kernels" if cuda == "1" else "CPU kernels (OPFORGE_CUDA=1 adds the CUDA ones)"
        print(f"opforge: building {what}; log in {LOG.relative_to(REPO)}", flush=True)
        start = time.monotonic()
        code, lines = _run(cmd, env, verbose)
        if code != 0:
            if not verbose:
                first, _ = _extension_helpers()._compiler_error("\n".join(lines))
                print(f"opforge: the build failed (exit {code}). First error:\n  {first.strip()}")
                print("--- last lines of the build log ---")
                print("\n".join(lines[-60:]))
            return code
        CONFIG.write_text(config)
        print(f"opforge: built in {time.monotonic() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
