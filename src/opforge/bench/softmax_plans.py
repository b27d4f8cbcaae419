"""Measures softmax launch plans on the current GPU, to set the default plan's rules.

    python -m opforge.bench.softmax_plans [--shapes 8192x1024,65536x128] [--dtypes float32,bfloat16]
                                          [--modes fwd,bwd] [--compiled] [--json plans.json]

For each shape, dtype and mode it times, as device time with inputs rotated
past the L2 cache (``timing.time_cuda``): every plan the kernels accept for
that row length (``torch.ops.opforge_bench.softmax_plan`` /
``softmax_backward_plan``: threads per row, rows per block, 16-byte vectors
per thread, cluster or two-pass split for rows longer than a block, and
float32 forward clusters that stay resident and walk the rows; backward
clusters hold y only, so they take up to the forward's vectors per thread), the
default plan (``opforge.softmax``), eager torch (with ``--compiled``, its
``torch.compile`` too) and a device copy of the same bytes. Each plan's
result is checked against eager before it is timed. Prints the fastest
plans per case; ``--json`` keeps every measurement.
"""

from __future__ import annotations

import argparse
import json
import math

import torch

import opforge

from . import harness, timing

DEFAULT_SHAPES = "8192x1024,8192x8192,4096x32768,65536x128,512x262144"


def _pow2(lo: int, hi: int) -> list[int]:
    out, v = [], lo
    while v <= hi:
        out.append(v)
        v *= 2
    return out


def max_vectors(dtype: torch.dtype, arrays: int) -> int:
    """Vectors per thread the kernels allow: 64 registers' worth of opmath values, or for
    the 2-byte types of values as loaded (two per register)."""
    size = torch.empty((), dtype=dtype).element_size()
    v = 16 // size
    words_per_vec = v // 2 * arrays if size == 2 else v * arrays * (2 if size == 8 else 1)
    it = 16
    while it > 1 and it * words_per_vec > 64:
        it //= 2
    return it


def candidates(k: int, dtype: torch.dtype, arrays: int) -> list[tuple]:
    """(threads_per_row, rows_per_block, vectors_per_thread, cluster, persistent) plans worth timing
    for rows of k."""
    size = torch.empty((), dtype=dtype).element_size()
    v = 16 // size
    out = []
    itmax = max_vectors(dtype, arrays)
    # The backward's clusters hold y only (bwd_cluster_kernel, 4 or more vectors per thread):
    # the forward's budget.
    itcluster = max_vectors(dtype, 1)
    for it in _pow2(1, max(itmax, itcluster)):
        resident = arrays == 1 and size == 4  # resident clusters: the 4-byte forward
        for tpr in _pow2(1, 512):
            cap = tpr * v * it
            if it > itmax:
                if tpr >= 256 and cap < k and math.ceil(k / cap) <= 16 and it >= 4:
                    out.append((tpr, 1, it, True, False))
                continue
            if cap >= k:
                if tpr > 1 and cap >= 2 * k:
                    continue  # half the threads would hold the row
                for rpb in _pow2(1, 512 // tpr):
                    if tpr * rpb in (128, 256, 512) or (rpb == 1 and tpr * rpb > 512 // 2):
                        out.append((tpr, rpb, it, False, False))
                if resident and tpr >= 128:
                    out.append((tpr, 1, it, True, True))  # a resident block per row
            elif tpr >= 128:
                if math.ceil(k / cap) <= 16:
                    if tpr >= 256:
                        out.append((tpr, 1, it, True, False))
                    if resident:
                        out.append((tpr, 1, it, True, True))
                if tpr >= 256 and math.ceil(k / cap) <= 64:
                    out.append((tpr, 1, it, False, False))
    return out


def _sets(make, nbytes: int, cache: int) -> list:
    return [make() for _ in range(harness.input_set_count(nbytes, cache))]


def _timed(fn, sets) -> float:
    state = [0]

    def call():
        state[0] = (state[0] + 1) % len(sets)
        fn(*sets[state[0]])

    call()
    return timing.time_cuda(call, warmup_ms=5.0, rep_ms=20.0).median_ms


def measure(
    m: int, k: int, dtype: torch.dtype, mode: str, bandwidth: float, cache: int, compiled: bool = False
) -> list[dict]:
    s = torch.empty((), dtype=dtype).element_size()
    if mode == "fwd":
        nbytes = 2 * m * k * s

        def make():
            return (torch.randn(m, k, device="cuda", dtype=dtype),)

        providers = {"eager": lambda x: torch.softmax(x, -1), "default": opforge.softmax, "copy": lambda x: x.clone()}
        plan_op = torch.ops.opforge_bench.softmax_plan
        arrays = 1
    else:
        nbytes = 3 * m * k * s

        def make():
            g = torch.randn(m, k, device="cuda", dtype=dtype)
            return (g, torch.softmax(torch.randn(m, k, device="cuda", dtype=dtype), -1))

        providers = {
            "eager": lambda g, y: torch._softmax_backward_data(g, y, -1, dtype),
            "default": lambda g, y: torch.ops.opforge._softmax_backward(g, y, -1),
            "copy": lambda g, y: g.add(y),
        }
        plan_op = torch.ops.opforge_bench.softmax_backward_plan
        arrays = 2
    if compiled:
        # torch.compile of eager's composition, the other baseline of `opforge bench`.
        providers["compiled"] = torch.compile(providers["eager"], dynamic=False)
    sets = _sets(make, nbytes, cache)
    want = providers["eager"](*sets[0])
    rows = []

    def record(name, fn):
        try:
            got = fn(*sets[0])
            ok = name == "copy" or torch.allclose(got.float(), want.float(), rtol=2e-2, atol=1e-3)
            ms = _timed(fn, sets) if ok else None
        except (RuntimeError, ValueError) as exc:
            ok, ms = False, None
            name = f"{name} ({str(exc).splitlines()[0][:80]})"
        rows.append(
            {
                "shape": f"{m}x{k}",
                "dtype": str(dtype).removeprefix("torch."),
                "mode": mode,
                "plan": name,
                "ok": ok,
                "ms": ms,
                "pct_floor": (100 * nbytes / (ms * 1e-3) / 1e9 / bandwidth) if ms else None,
            }
        )

    for name, fn in providers.items():
        record(name, fn)
    for plan in candidates(k, dtype, arrays):
        kind = "resident" if plan[4] else "cluster" if plan[3] else "-"
        args = plan if plan[4] else plan[:4]  # the backward op has no resident clusters
        record(f"plan {plan[0]}/{plan[1]}/{plan[2]}/{kind}", lambda *a, args=args: plan_op(*a, *args))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--modes", default="fwd,bwd")
    ap.add_argument("--top", type=int, default=4)
    ap.add_argument("--compiled", action="store_true", help="also time torch.compile of eager's composition")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("softmax_plans: needs a CUDA GPU")
        return 2
    bandwidth = timing.copy_bandwidth_gbps("cuda")
    cache = torch.cuda.get_device_properties(0).L2_cache_size
    print(f"{torch.cuda.get_device_name()}: device copy {bandwidth:.0f} GB/s")
    everything = []
    for shape in args.shapes.split(","):
        m, k = (int(v) for v in shape.split("x"))
        for dname in args.dtypes.split(","):
            dtype = getattr(torch, dname)
            for mode in args.modes.split(","):
                rows = measure(m, k, dtype, mode, bandwidth, cache, args.compiled)
                everything += rows
                fixed = {r["plan"]: r for r in rows if not r["plan"].startswith("plan")}
                plans = sorted((r for r in rows if r["plan"].startswith("plan") and r["ms"]), key=lambda r: r["ms"])
                line = "  ".join(f"{n} {r['ms']:.4f}" for n, r in fixed.items() if r["ms"])
                print(f"{shape} {dname} {mode}: {line}")
                for r in plans[: args.top]:
                    print(f"    {r['plan']:<24} {r['ms']:.4f} ms  {r['pct_floor']:.0f}% floor")
                bad = [r["plan"] for r in rows if not r["ok"]]
                if bad:
                    print(f"    failed: {', '.join(bad)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bandwidth_gbps": bandwidth, "rows": everything}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
