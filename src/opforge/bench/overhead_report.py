"""``opforge bench overhead`` results as a terminal table, Markdown and JSON."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from .noise import SPREAD_LIMIT, busy_line
from .overhead import PROVIDERS, Row, Run, Settings, Timed

SCHEMA = "opforge-bench-overhead/1"

HEADER = [
    "op",
    "input",
    "grad",
    "opforge us",
    "torch us",
    "opforge / torch",
    "floor wrapper us",
    "floor torch.ops us",
    "torch code",
]
_RIGHT = range(3, 8)


def _us(t: Timed | None, row: Row) -> str:
    if row.status != "ok":
        return row.status
    return "-" if t is None else f"{t.median_us:.2f}"


def rows(run: Run) -> list[list[str]]:
    out = []
    for r in run.rows:
        p = r.providers
        out.append(
            [
                r.op,
                r.shape,
                "yes" if r.grad else "no",
                _us(p["opforge"], r),
                _us(p["torch"], r),
                "-" if r.ratio is None else f"{r.ratio:.2f}",
                _us(p["floor_wrapper"], r),
                _us(p["floor_direct"], r),
                r.torch_name,
            ]
        )
    return out


def spreads(run: Run) -> list[tuple[float, Row, str]]:
    """(p80/p20, row, provider) for every timed provider above the spread limit, worst first."""
    out = [
        (t.p80_us / t.p20_us, r, k)
        for r in run.rows
        for k, t in r.providers.items()
        if t is not None and t.p20_us > 0 and t.p80_us / t.p20_us > SPREAD_LIMIT
    ]
    return sorted(out, key=lambda s: -s[0])


def busy_warning(run: Run) -> str | None:
    """The harness's rule: load above the usable cores at either end, or unsteady samples."""
    spread = spreads(run)
    worst = None
    if spread:
        ratio, r, key = spread[0]
        worst = (ratio, f"{r.op} grad={'yes' if r.grad else 'no'} {key}")
    return busy_line(run.environment, len({id(s[1]) for s in spread}), len(run.rows), worst)


def _summary_line(run: Run) -> str:
    env, s = run.environment, run.settings
    where = env.get("gpu") if s.device == "cuda" else f"{env['cpu']} ({env['cpu_cores']} cores)"
    load = env.get("load_avg_1m_start"), env.get("load_avg_1m")
    return (
        f"opforge {env['opforge']} on {s.device} ({where}); torch {env['torch']}, "
        f"torch threads: {env.get('torch_threads')}; "
        f"{s.repeats} loops of {s.calls} calls per provider; load average {load[0]} at the start, "
        f"{load[1]} at the end"
    )


def _notes(run: Run) -> list[str]:
    warning = busy_warning(run)
    notes = [warning] if warning else []
    notes += [f"{r.op} grad={'yes' if r.grad else 'no'}: {r.status}: {r.detail}" for r in run.rows if r.status != "ok"]
    notes.append(
        "us = median microseconds per call, the host's time (the device synchronised around each loop); "
        "opforge / torch below 1 means opforge's call costs less; floor = opforge_bench.noop, a "
        "registered C++ op that returns an empty tensor, called through a Python wrapper as opforge's "
        "ops are, and as torch.ops.opforge_bench.noop(x); grad = the inputs require grad "
        f"(the call records its graph; no backward runs); {run.seconds:.1f} s in all"
    )
    return notes


def table(run: Run) -> str:
    body = rows(run)
    widths = [max([len(HEADER[i])] + [len(b[i]) for b in body]) for i in range(len(HEADER))]

    def fmt(cells):
        return "  ".join(c.rjust(w) if i in _RIGHT else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    lines = [_summary_line(run)]
    if busy_warning(run):
        lines.append(busy_warning(run))
    lines += ["", fmt(HEADER), "  ".join("-" * w for w in widths), *(fmt(b) for b in body)]
    return "\n".join(lines + ["", *_notes(run)])


def markdown(run: Run) -> str:
    env = run.environment
    warning = busy_warning(run)
    lines = [
        "# opforge per-call host overhead",
        "",
        _summary_line(run) + ".",
        "",
        *([f"**{warning}**", ""] if warning else []),
        f"Commit `{env.get('git_commit')}`, measured {env['date_utc']}; p20/p80 are in the JSON. "
        "See docs/bench.md (`opforge bench overhead`) for the method.",
        "",
        "| " + " | ".join(HEADER) + " |",
        "| " + " | ".join("---:" if i in _RIGHT else "---" for i in range(len(HEADER))) + " |",
    ]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in b) + " |" for b in rows(run)]
    lines += ["", "Notes:", "", *(f"- {n}" for n in _notes(run))]
    lines += ["", "Environment:", "", "| key | value |", "| --- | --- |", *(f"| {k} | {v} |" for k, v in env.items())]
    return "\n".join(lines) + "\n"


def to_json(run: Run) -> dict:
    return {
        "schema": SCHEMA,
        "environment": run.environment,
        "settings": dataclasses.asdict(run.settings),
        "seconds": run.seconds,
        "results": [
            {
                "op": r.op,
                "shape": r.shape,
                "grad": r.grad,
                "torch_name": r.torch_name,
                "status": r.status,
                "detail": r.detail,
                "ratio_opforge_over_torch": r.ratio,
                "providers": {k: None if t is None else dataclasses.asdict(t) for k, t in r.providers.items()},
            }
            for r in run.rows
        ],
    }


def from_json(data: dict) -> Run:
    """The run a :func:`to_json` dict describes."""
    if data.get("schema") != SCHEMA:
        raise ValueError(f"not an overhead result: schema {data.get('schema')!r}, expected {SCHEMA!r}")
    rows_ = [
        Row(
            op=r["op"],
            shape=r["shape"],
            grad=r["grad"],
            torch_name=r["torch_name"],
            status=r["status"],
            detail=r["detail"],
            providers={k: None if (t := r["providers"].get(k)) is None else Timed(**t) for k in PROVIDERS},
        )
        for r in data["results"]
    ]
    return Run(Settings(**data["settings"]), data["environment"], rows_, data.get("seconds", 0.0))


def write_json(run: Run, path: str | os.PathLike) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(to_json(run), indent=1) + "\n")


def write_markdown(run: Run, path: str | os.PathLike) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(markdown(run))
