"""Bench results as a terminal table, JSON, Markdown and a PNG chart."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch

from . import timing
from .machine import cpu_model as _cpu_model  # noqa: F401  (read by `opforge info`)
from .noise import busy_warning, floor_notes
from .results import PROVIDERS, CaseResult, ProviderResult, Run, Settings

SCHEMA = "opforge-bench/1"


# ---------------------------------------------------------------------------
# Formatting


def _ms(res) -> str:
    if res is None:
        return "-"
    if res.status != "ok":
        return res.status
    return f"{res.median_ms:.4f}" if res.median_ms < 10 else f"{res.median_ms:.2f}"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _roof(r: CaseResult) -> tuple[str, str]:
    """(rate, % of floor) of opforge: GB/s and % for memory-bound cases, TFLOP/s for compute-bound."""
    ours = r.providers["opforge"]
    if ours.gbps is not None:
        return f"{ours.gbps:.1f} GB/s", f"{ours.pct_floor:.0f}%" if ours.pct_floor is not None else "-"
    if ours.tflops is not None:
        return f"{ours.tflops:.2f} TFLOP/s", "-"
    return "-", "-"


def _mib(res) -> str:
    if res is None or res.peak_mem_bytes is None:
        return "-"
    return f"{res.peak_mem_bytes / 2**20:.0f}"


def rows(run: Run) -> tuple[list[str], list[list[str]]]:
    """The table's header and rows; peak-memory columns only when memory was measured (GPU)."""
    with_mem = any(p.peak_mem_bytes is not None for r in run.results for p in r.providers.values())
    header = [
        "op",
        "shape",
        "dtype",
        "mode",
        "opforge ms",
        "eager ms",
        "compiled ms",
        "peer ms",
        "vs eager",
        "vs compiled",
        "vs peer",
        "opforge rate",
        "% floor",
        "% of copy",
    ]
    if with_mem:
        header += ["peak MiB opforge/eager/compiled"]
    out = []
    for r in run.results:
        rate, pct = _roof(r)
        peer = r.providers.get("peer")
        row = [
            r.op,
            r.shape,
            r.dtype,
            r.mode,
            _ms(r.providers["opforge"]),
            _ms(r.providers["eager"]),
            _ms(r.providers.get("compiled")),
            (f"{_ms(peer)} ({peer.name})" if peer is not None else "-"),
            _x(r.speedup("eager")),
            _x(r.speedup("compiled")),
            _x(r.speedup("peer")),
            rate,
            pct,
            "-" if r.pct_copy is None else f"{r.pct_copy:.0f}%",
        ]
        if with_mem:
            row.append("/".join(_mib(r.providers.get(k)) for k in ("opforge", "eager", "compiled")))
        out.append(row)
    return header, out


def _notes(run: Run) -> list[str]:
    """The busy-machine warning (also above the table), problems, failures, and what % floor means."""
    warning = busy_warning(run)
    notes = ([warning] if warning else []) + list(run.problems)
    for r in run.results:
        for key, p in r.providers.items():
            if p.status != "ok":
                notes.append(f"{r.op} {r.shape} {r.dtype} {r.mode}: {key} ({p.name}) {p.status}: {p.detail}")
    return notes + floor_notes(run)


def _legend(run: Run) -> str:
    copy = any(r.pct_copy is not None for r in run.results)
    return (
        "times: median ms; vs X = X's time / opforge's (above 1.00x opforge is faster)"
        + ("; % of copy = the time of a device copy of the same bytes / opforge's" if copy else "")
        + f"; {run.seconds:.0f} s in all"
    )


def _summary_line(run: Run) -> str:
    env = run.environment
    where = (
        env["gpu"] if run.settings.device == "cuda" else f"{env['cpu']} ({env['cpu_cores']} cores, {env['cpu_isa']})"
    )
    return (
        f"opforge {env['opforge']} on {run.settings.device} ({where}); torch {env['torch']}"
        + (f", CUDA {env['cuda']}" if env.get("cuda") else "")
        + f"; device copy {run.copy_bandwidth_gbps:.1f} GB/s; last-level cache {run.cache_bytes >> 20} MiB"
        + ("; quick" if run.settings.quick else "")
    )


def table(run: Run) -> str:
    header, body = rows(run)
    widths = [max(len(header[i]), *(len(b[i]) for b in body)) if body else len(header[i]) for i in range(len(header))]
    right = set(range(4, len(header)))

    def fmt(cells):
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    lines = [_summary_line(run)]
    if busy_warning(run):
        lines.append(busy_warning(run))
    lines += ["", fmt(header), "  ".join("-" * w for w in widths)]
    lines += [fmt(b) for b in body]
    if not body:
        lines.append("(no cases selected)")
    lines += ["", *_notes(run), _legend(run)]
    return "\n".join(lines)


def markdown(run: Run) -> str:
    header, body = rows(run)
    env = run.environment
    lines = [
        "# opforge benchmark results",
        "",
        _summary_line(run) + ".",
        "",
        *([f"**{busy_warning(run)}**", ""] if busy_warning(run) else []),
        f"Commit `{env.get('git_commit')}`, measured {env['date_utc']}. "
        f"{_legend(run)[0].upper()}{_legend(run)[1:]}; p20/p80 are in the JSON. See docs/bench.md for the method.",
        "",
        "| " + " | ".join(header) + " |",
        "| " + " | ".join("---" if i < 4 else "---:" for i in range(len(header))) + " |",
    ]
    lines += ["| " + " | ".join(b) + " |" for b in body]
    notes = _notes(run)
    if notes:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    lines += ["", "Environment:", "", "| key | value |", "| --- | --- |"]
    lines += [f"| {k} | {v} |" for k, v in env.items()]
    return "\n".join(lines) + "\n"


def to_json(run: Run) -> dict:
    s = run.settings
    return {
        "schema": SCHEMA,
        "environment": run.environment,
        "settings": {
            "device": s.device,
            "quick": s.quick,
            "modes": list(s.modes),
            "dtypes": None if s.dtypes is None else [str(d).removeprefix("torch.") for d in s.dtypes],
            "ops": list(s.ops),
            "compile": s.compile,
            "timer": timing.describe(s.device, s.quick),
        },
        "copy_bandwidth_gbps": run.copy_bandwidth_gbps,
        "last_level_cache_bytes": run.cache_bytes,
        "seconds": run.seconds,
        "problems": run.problems,
        "results": [
            {
                "family": r.family,
                "op": r.op,
                "shape": r.shape,
                "dtype": r.dtype,
                "mode": r.mode,
                "bytes": r.bytes,
                "flops": r.flops,
                "input_sets": r.input_sets,
                "copy_ms": r.copy_ms,
                "pct_copy": r.pct_copy,
                "speedup_vs_eager": r.speedup("eager"),
                "speedup_vs_compiled": r.speedup("compiled"),
                "speedup_vs_peer": r.speedup("peer"),
                "providers": {k: dataclasses.asdict(p) for k, p in r.providers.items()},
            }
            for r in run.results
        ],
    }


def from_json(data: dict) -> Run:
    """The run a ``to_json`` dict describes, to redraw a saved result's table and chart."""
    if data.get("schema") != SCHEMA:
        raise ValueError(f"not an opforge benchmark result: schema {data.get('schema')!r}, expected {SCHEMA!r}")
    s = data["settings"]
    settings = Settings(
        device=s["device"],
        quick=s["quick"],
        modes=tuple(s["modes"]),
        dtypes=None if s["dtypes"] is None else tuple(getattr(torch, d) for d in s["dtypes"]),
        ops=tuple(s["ops"]),
        compile=s["compile"],
    )
    results = [
        CaseResult(
            family=r["family"],
            op=r["op"],
            shape=r["shape"],
            dtype=r["dtype"],
            mode=r["mode"],
            bytes=r["bytes"],
            flops=r["flops"],
            input_sets=r["input_sets"],
            copy_ms=r.get("copy_ms"),
            providers={k: ProviderResult(**p) for k, p in r["providers"].items()},
        )
        for r in data["results"]
    ]
    return Run(
        settings,
        data["environment"],
        data["copy_bandwidth_gbps"],
        data["last_level_cache_bytes"],
        results,
        data.get("seconds", 0.0),
        data.get("problems", []),
    )


def read_json(path: str | os.PathLike) -> Run:
    return from_json(json.loads(Path(path).read_text()))


def write_json(run: Run, path: str | os.PathLike) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(to_json(run), indent=1) + "\n")


def write_markdown(run: Run, path: str | os.PathLike) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(markdown(run))


def write_plot(run: Run, path: str | os.PathLike) -> None:
    """Two panels: speedup over eager and over torch.compile per case; % of floor per provider."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = [r for r in run.results if r.providers["opforge"].status == "ok"]
    labels = [f"{r.op} {r.shape} {r.dtype} {r.mode}" for r in res]
    n = max(len(res), 1)
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(8.0, 0.55 * n + 3), 9), constrained_layout=True)
    xs = list(range(len(res)))
    w = 0.38

    def vals(fn):  # a missing value (provider failed or absent) is not drawn
        return [v if (v := fn(r)) else float("nan") for r in res]

    ax1.bar([x - w / 2 for x in xs], vals(lambda r: r.speedup("eager")), w, label="over eager")
    ax1.bar([x + w / 2 for x in xs], vals(lambda r: r.speedup("compiled")), w, label="over torch.compile")
    ax1.axhline(1.0, color="black", linewidth=0.8)
    if res:
        from matplotlib.ticker import FuncFormatter

        ax1.set_yscale("log", base=2)
        ax1.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    ax1.set_ylabel("opforge speedup (log scale)")
    ax1.set_title(_summary_line(run), fontsize=8)
    ax1.legend(fontsize=8)

    w3 = 0.27
    for j, key in enumerate(("opforge", "eager", "compiled")):
        ys = [(r.providers[key].pct_floor or float("nan")) if key in r.providers else float("nan") for r in res]
        ax2.bar([x + (j - 1) * w3 for x in xs], ys, w3, label=key)
    ax2.axhline(100.0, color="black", linewidth=0.8, linestyle="--")
    ax2.set_ylabel("% of the copy-bandwidth floor")
    ax2.legend(fontsize=8)
    for ax in (ax1, ax2):
        ax.set_xticks(xs)
        ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
    if not res:
        ax1.text(0.5, 0.5, "no case ran", ha="center", transform=ax1.transAxes)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


__all__ = [
    "PROVIDERS",
    "busy_warning",
    "table",
    "markdown",
    "to_json",
    "from_json",
    "read_json",
    "write_json",
    "write_markdown",
    "write_plot",
]
