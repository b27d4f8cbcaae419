"""Runs a set of tests many times, each time under another base seed, to find tolerances that a
random input can break (see docs/testing.md).

    .venv/bin/python tools/seed_sweep.py --runs 20            # base seeds 1..20
    .venv/bin/python tools/seed_sweep.py --runs 5 --first-seed 100 -- tests/test_nms.py -k random

Each run is one pytest process with `--seed S`. One line per run: the seed, how many tests passed
and failed, and the time; then every failure's node id with its base seed and the command that
reruns it. Exits 1 if any run had a failure. With no tests named, it runs the numerical tests
that draw random inputs: softmax, conv, add and nms against their references (about 2-3 minutes a
pass on two cores).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The default selection: the value, row-length and backward checks that compare with float64 or
# torchvision on random inputs (CPU; on a GPU the CUDA ones too), not the compile, opcheck and
# gradcheck tests, which draw little and take long.
DEFAULT = [
    "tests/test_softmax.py",
    "tests/test_conv.py",
    "tests/test_add.py",
    "tests/test_nms.py",
    "-k",
    # softmax
    "test_values or row_lengths or very_long_row or many_short or non_contiguous or inf_and_nan"
    " or offset_rows or exp_range or test_causal or fully_masked or scaled_masked_values"
    " or scaled_masked_backward_op or backward_op_values or autograd_matches"
    # conv (test_values above), add (test_values above), nms
    " or backward_matches_torch or depthwise_backward_stride or dense_larger or depthwise_larger"
    " or test_broadcasting or fused_backward_op_values or random_vs_torchvision or batched_vs_torchvision"
    # the per-ISA builds of softmax and add, in subprocesses seeded from the test
    " or every_cpu_isa_build",
]

SUMMARY = re.compile(r"(\d+) (passed|failed|error|errors)\b")
FAILED = re.compile(r"^(FAILED|ERROR) (\S+)", re.M)


def run_once(seed: int, tests: list[str], log_dir: Path) -> tuple[int, int, list[str], float]:
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "--tb=short",
        "-rfE",
        f"--seed={seed}",
        *tests,
    ]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    took = time.monotonic() - start
    out = proc.stdout + proc.stderr
    counts = {"passed": 0, "failed": 0}
    tail = out.strip().splitlines()[-1] if out.strip() else ""
    for n, kind in SUMMARY.findall(tail):
        counts["passed" if kind == "passed" else "failed"] += int(n)
    failures = [m.group(2) for m in FAILED.finditer(out)]
    if proc.returncode not in (0, 1) and not failures:
        failures = [f"(pytest exited {proc.returncode}: {tail or 'no output'})"]
        counts["failed"] = max(counts["failed"], 1)
    if failures:
        log = log_dir / f"seed_{seed}.log"
        log.write_text(out)
    return counts["passed"], counts["failed"], failures, took


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="how many base seeds (default 20)")
    parser.add_argument("--first-seed", type=int, default=1, help="the first base seed (default 1)")
    parser.add_argument(
        "--log-dir",
        type=Path,
        default=Path("/tmp/opforge_seed_sweep"),
        help="where a failing run's full pytest output goes",
    )
    parser.add_argument("tests", nargs="*", help="pytest arguments (after --); default: the numerical tests")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")
    tests = args.tests or DEFAULT
    args.log_dir.mkdir(parents=True, exist_ok=True)
    failed_runs = []
    for seed in range(args.first_seed, args.first_seed + args.runs):
        passed, failed, failures, took = run_once(seed, tests, args.log_dir)
        print(f"seed {seed:6d}  passed {passed:5d}  failed {failed:3d}  {took:7.1f} s", flush=True)
        if failures:
            failed_runs.append((seed, failures))
    if not failed_runs:
        print(f"all {args.runs} runs passed")
        return 0
    print(f"{len(failed_runs)} of {args.runs} runs failed:")
    for seed, failures in failed_runs:
        for nodeid in failures:
            print(f"  seed {seed}: {nodeid}")
            print(f"    rerun: OPFORGE_TEST_SEED={seed} .venv/bin/python -m pytest '{nodeid}'")
        print(f"  (full output: {args.log_dir / f'seed_{seed}.log'})")
    return 1


if __name__ == "__main__":
    sys.exit(main())
