"""Latency of one model three ways, side by side: Python eager, the AOTInductor package
from Python, and the C++ runner (cpp/runner), on one device, batch 1.

    python tools/deploy_latency.py [--device cpu|cuda] [--json PATH]

Also reports the package's and the kernel library's sizes and the runner's
cold start (process start to first output, from outside the process).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from opforge import _loader, deploy, native_build  # noqa: E402


def _median_ms(fn, device, calls=200):
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(20):
        fn()
    sync()
    samples = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json")
    args = ap.parse_args()
    spec = importlib.util.spec_from_file_location("example", REPO / "examples" / "deploy" / "small_detector.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    model = example.model().to(args.device)
    (x,) = example.example_inputs()
    out_dir = Path(tempfile.mkdtemp(prefix="opforge-deploy-"))
    made = deploy.package(model, (x.to(args.device),), out_dir)  # a dynamic batch, timed at 1
    x = x[:1].to(args.device)
    torch.save([x.cpu()], made.inputs)
    runner = deploy.build_runner()
    loaded = torch._inductor.aoti_load_package(str(made.package))
    with torch.no_grad():
        eager_ms = _median_ms(lambda: model(x), args.device)
        aoti_ms = _median_ms(lambda: loaded(x), args.device)
    env = native_build.run_env()
    t0 = time.perf_counter()
    cmd = [str(runner), str(made.package), str(made.inputs), str(out_dir / "o.pt")]
    subprocess.run(cmd, check=True, capture_output=True, env=env)
    cold_ms = (time.perf_counter() - t0) * 1e3
    proc = subprocess.run([*cmd, "--repeat", "200"], check=True, capture_output=True, text=True, env=env)
    runner_ms = float(re.search(r"latency_ms median ([\d.]+)", proc.stdout).group(1))
    result = {
        "device": args.device,
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
        "torch": torch.__version__,
        "python_eager_ms": eager_ms,
        "python_aoti_ms": aoti_ms,
        "cpp_runner_ms": runner_ms,
        "runner_cold_start_ms": cold_ms,
        "package_bytes": made.package_bytes,
        "kernel_library_bytes": Path(_loader.library_path()).stat().st_size,
        "package_compile_s": made.compile_seconds,
    }
    for k, v in result.items():
        print(f"{k:24} {v:.4f}" if isinstance(v, float) else f"{k:24} {v}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
