"""``opforge bench models`` results: a table (ms and speed-ups), Markdown, JSON and a chart."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from .machine import environment
from .models import PROVIDERS, Cell, CellResult, Timed

SCHEMA = "opforge-bench-models/1"


def cell_label(c: Cell) -> str:
    return f"{c.model} {c.device} {c.dtype} batch {c.batch} {c.layout} {c.mode}"


def _best_compiled(r: CellResult, names) -> float | None:
    times = [r.providers[n].ms for n in names if n in r.providers and r.providers[n].ms is not None]
    return min(times) if times else None


def rows(results: list[CellResult]) -> tuple[list[str], list[list[str]]]:
    header = ["model", "dtype", "batch", "layout", "mode"] + [f"{p} ms" for p in PROVIDERS]
    header += ["optimize / eager", "compile(optimize) / best compile", "max rel error"]
    out = []
    for r in results:
        c, p = r.cell, r.providers
        line = [c.model, c.dtype, str(c.batch), c.layout, c.mode]
        for name in PROVIDERS:
            t = p.get(name)
            line.append("-" if t is None else (f"{t.ms:.2f}" if t.ms is not None else t.status.split(":")[0]))
        eager, opt = p.get("eager"), p.get("optimize")
        speed = eager.ms / opt.ms if eager and opt and eager.ms and opt.ms else None
        best = _best_compiled(r, ("compile", "compile_freezing", "compile_ro"))
        ours = _best_compiled(r, ("compile_optimize", "compile_optimize_ro"))
        line.append(f"{speed:.2f}x" if speed else "-")
        line.append(f"{best / ours:.2f}x" if best and ours else "-")
        errs = [t.max_rel_error for t in p.values() if t.max_rel_error is not None]
        line.append(f"{max(errs):.1e}" if errs else "-")
        out.append(line)
    return header, out


def table(results: list[CellResult]) -> str:
    header, body = rows(results)
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(b, widths, strict=True)) for b in body]
    failed = [(cell_label(r.cell), n, t.status) for r in results for n, t in r.providers.items() if t.status != "ok"]
    lines += [f"{label}: {name} {status}" for label, name, status in failed]
    return "\n".join(lines)


def read_json(path: str) -> tuple[dict, list[CellResult]]:
    """(environment, results) of a file write_json wrote: runs made apart merge into one table. Each
    result carries the environment of the run that measured it (its own entry, else the file's)."""
    data = json.loads(Path(path).read_text())
    if data.get("schema") != SCHEMA:
        raise ValueError(f"{path}: not an opforge bench models result (schema {data.get('schema')!r}, want {SCHEMA!r})")
    results = [
        CellResult(
            Cell(**r["cell"]),
            {k: _timed(v) for k, v in r["providers"].items()},
            r.get("environment") or data["environment"],
        )
        for r in data["results"]
    ]
    return data["environment"], results


_TIMED_FIELDS = {f.name for f in dataclasses.fields(Timed)}


def _timed(entry: dict) -> Timed:
    # Fields a later version added are skipped: a newer file still merges here.
    return Timed(**{k: v for k, v in entry.items() if k in _TIMED_FIELDS})


def common_environment(results: list[CellResult]) -> dict:
    """What every result's run shares (torch, GPU, ...): a merged file's own environment, so that it
    names no single run's sources or date for cells that other runs measured."""
    envs = [r.environment for r in results if r.environment]
    if not envs:
        return {}
    return {k: v for k, v in envs[0].items() if all(e.get(k) == v for e in envs[1:])}


def write_json(results: list[CellResult], path: str, device: str, env: dict | None = None) -> None:
    env = environment(device) if env is None else env
    data = {
        "schema": SCHEMA,
        "environment": env,
        "results": [
            {
                "cell": dataclasses.asdict(r.cell),
                "providers": {k: dataclasses.asdict(v) for k, v in r.providers.items()},
                # A cell another run measured names that run.
                **({"environment": r.environment} if r.environment and r.environment != env else {}),
            }
            for r in results
        ],
    }
    # Written whole, then renamed: a run stopped mid-write leaves the previous file, never half of one.
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


# What tells one run from another: its sources, torch and machine (a run's cells may have been
# measured by several commands, minutes apart, each with its own date and load). Each is printed
# in the run's line, so that two runs never read alike.
_RUN_KEYS = ("git_commit", "torch", "gpu", "cpu")


def _run_of(r: CellResult) -> tuple | None:
    return tuple(r.environment.get(k) for k in _RUN_KEYS) if r.environment else None


def _run_line(label: str, members: list[CellResult]) -> str:
    env = members[0].environment
    full = env.get("git_commit") or "unknown"
    commit = full[:7] + ("-dirty" if full.endswith("-dirty") else "")  # changes not committed
    dates = sorted({r.environment["date_utc"][:10] for r in members if r.environment.get("date_utc")})
    when = f", {dates[0]}" + (f" to {dates[-1]}" if len(dates) > 1 else "") if dates else ""
    machine = ", ".join(str(env[k]) for k in ("gpu", "cpu") if env.get(k)) or "machine unknown"
    cells = f"{len(members)} cell" + ("s" if len(members) != 1 else "")
    return f"- run {label}: sources {commit}{when}, {machine}, torch {env.get('torch', '?')}: {cells}"


def _machine(env: dict, device: str, runs: int) -> str:
    """The header's machine and torch: the file's, or where runs differ in them, the runs' list."""
    machine = env.get("gpu") or (env.get("cpu") if device == "cpu" else None)
    if runs > 1:
        machine = machine or "machines per run (below)"
        return f"{machine}; torch {env.get('torch') or 'per run (below)'}"
    return f"{machine or env.get('cpu', device)}; torch {env.get('torch', '?')}"


def write_markdown(results: list[CellResult], path: str, device: str, env: dict | None = None) -> None:
    header, body = rows(results)
    env = environment(device) if env is None else env
    # Each run's label, numbered in first-seen order.
    runs = {run: str(i + 1) for i, run in enumerate(dict.fromkeys(_run_of(r) for r in results if r.environment))}
    if len(runs) > 1:  # a merged table: each row says which run measured it
        header = header + ["run"]
        body = [b + [runs[_run_of(r)] if r.environment else "-"] for b, r in zip(body, results, strict=True)]
    lines = [
        f"# opforge on whole models ({device})",
        "",
        f"{_machine(env, device, len(runs))}. Median ms per call "
        "(inference: forward under no_grad; train: forward + backward + SGD step). "
        "See `opforge bench models --help` and the docstring of opforge/bench/models.py for the method.",
        "",
        "| " + " | ".join(header) + " |",
        "| " + " | ".join("---" for _ in header) + " |",
    ]
    lines += ["| " + " | ".join(b) + " |" for b in body]
    if len(runs) > 1:
        lines += ["", f"Measured in {len(runs)} runs:", ""]
        lines += [_run_line(label, [r for r in results if _run_of(r) == run]) for run, label in runs.items()]
    Path(path).write_text("\n".join(lines) + "\n")


def write_plot(results: list[CellResult], path: str) -> None:
    """One group of bars per cell: each provider's speed-up over eager (log scale), the
    providers that did not run left out. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    names = [p for p in PROVIDERS if p != "eager" and any(p in r.providers for r in results)]
    fig, ax = plt.subplots(figsize=(max(8.0, 1.3 * len(results) + 3), 5.5), constrained_layout=True)
    width = 0.8 / max(len(names), 1)
    for j, name in enumerate(names):
        ys = []
        for r in results:
            eager, t = r.providers.get("eager"), r.providers.get(name)
            ok = eager is not None and t is not None and eager.ms and t.ms
            ys.append(eager.ms / t.ms if ok else float("nan"))
        ax.bar([i + (j - (len(names) - 1) / 2) * width for i in range(len(results))], ys, width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log", base=2)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.set_ylabel("speed-up over eager (log scale)")
    ax.set_xticks(range(len(results)))
    labels = [f"{r.cell.model}\n{r.cell.dtype} b{r.cell.batch} {r.cell.layout}\n{r.cell.mode}" for r in results]
    ax.set_xticklabels(labels, fontsize=7)
    ax.legend(fontsize=7, ncol=3)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
