"""How far a run's numbers can be trusted: a busy machine, unsteady timings,
and what "% floor" means, above 100% included.

Pure functions of a :class:`~opforge.bench.results.Run` (a saved one too), so
the table, the Markdown and ``--from-json`` say the same thing.
"""

from __future__ import annotations

from .results import CaseResult, Run

# A case's p80/p20 above this means its samples disagree by more than the
# differences the table reports (on a quiet machine they stay within ~1.2).
SPREAD_LIMIT = 1.5

# How many rows a note names before it says "and N more".
_NAMED = 3


def _row(r: CaseResult) -> str:
    return f"{r.op} {r.shape} {r.dtype} {r.mode}"


def _more(items: list[str]) -> str:
    shown = ", ".join(items[:_NAMED])
    return shown + (f" and {len(items) - _NAMED} more" if len(items) > _NAMED else "")


def busy_loads(env: dict) -> list[str]:
    """The load averages (at the run's start, at its end) above the usable cores, in words.

    A 1-minute load above the cores the run may use means runnable tasks
    waited for a core, this run's threads among them.
    """
    cores = env.get("usable_cores") or env.get("cpu_cores")
    if not cores:
        return []
    out = []
    for key, when in (("load_avg_1m_start", "start"), ("load_avg_1m", "end")):
        load = env.get(key)
        if load is not None and load > cores:
            out.append(f"{load:.1f} at the {when}")
    return out


def spreads(run: Run) -> list[tuple[float, CaseResult, str]]:
    """(p80/p20, case, provider) for every timed provider above SPREAD_LIMIT, worst first."""
    out = []
    for r in run.results:
        for key, p in r.providers.items():
            if p.status == "ok" and p.p20_ms and p.p80_ms and p.p80_ms / p.p20_ms > SPREAD_LIMIT:
                out.append((p.p80_ms / p.p20_ms, r, key))
    return sorted(out, key=lambda t: -t[0])


def busy_warning(run: Run) -> str | None:
    """One line when the machine was busy (load above its cores) or timings were unsteady; else None."""
    spread = spreads(run)
    worst = (spread[0][0], f"{_row(spread[0][1])} {spread[0][2]}") if spread else None
    return busy_line(run.environment, len({id(c) for _, c, _ in spread}), len(run.results), worst)


def busy_line(environment: dict, unsteady_rows: int, rows: int, worst: tuple[float, str] | None) -> str | None:
    """The busy-machine warning shared by every report: the load at either end of
    the run above its usable cores, and `unsteady_rows` of `rows` whose p80/p20
    is above SPREAD_LIMIT (`worst`: the largest ratio and what it belongs to)."""
    loads = busy_loads(environment)
    if not loads and not unsteady_rows:
        return None
    reasons = []
    if loads:
        cores = environment.get("usable_cores") or environment.get("cpu_cores")
        reasons.append(f"busy machine: load average {' and '.join(loads)} of the run, above its {cores} cores")
    if unsteady_rows:
        reasons.append(
            f"unsteady timings: p80/p20 above {SPREAD_LIMIT:g} in {unsteady_rows} of {rows} rows "
            f"(worst {worst[0]:.2f}, {worst[1]})"
        )
    return f"warning: {'; '.join(reasons)}; the times are unreliable, rerun on a quiet machine"


def _which(n: int, total: int) -> str:
    """The subject of a reason that applies to n of the total rows named."""
    return "it moves" if total == 1 else "all move" if n == total else f"{n} of them move"


def _shown_pct(value: float | None) -> int | None:
    """The percentage as the table prints it (rounded to a whole number)."""
    return None if value is None else int(f"{value:.0f}")


def floor_notes(run: Run) -> list[str]:
    """What "% floor" is, and why rows that show more than 100% of it can.

    The reason note appears exactly when a row's printed % floor or % of copy
    exceeds 100.
    """
    memory_bound = [r for r in run.results if r.providers["opforge"].pct_floor is not None]
    if not memory_bound:
        return []
    notes = [
        f"% floor = floor time / opforge's time, the floor being the fewest bytes the op must move (inputs read "
        f"once, outputs written once) at the device-copy bandwidth measured at the start "
        f"({run.copy_bandwidth_gbps:.1f} GB/s)"
    ]
    over = [r for r in memory_bound if _shown_pct(r.providers["opforge"].pct_floor) > 100]
    if over:
        named = [f"{_row(r)} {_shown_pct(r.providers['opforge'].pct_floor)}%" for r in over]
        cached = [r for r in over if r.bytes <= run.cache_bytes]
        reason = []
        if cached:
            reason.append(
                f"{_which(len(cached), len(over))} at most {max(r.bytes for r in cached) / 2**20:.0f} MiB per call, "
                f"within the {run.cache_bytes >> 20} MiB last-level cache: inputs are rotated past it, but "
                f"outputs land in memory just freed and still cached, so such a call beats the memory "
                f"bandwidth the floor assumes"
            )
        if run.settings.device == "cpu":
            reason.append(
                "on the CPU the floor's copy also reads its destination before writing it "
                "(write-allocate), which the floor does not count, so the floor is low"
            )
        elif len(cached) < len(over):
            reason.append(
                f"{_which(len(over) - len(cached), len(over))} more than the cache holds: an op that reads more "
                f"than it writes can beat the half-read, half-write copy the floor is measured with "
                f"by a few percent"
            )
        notes.append(f"above 100% of the floor ({_more(named)}): {'; '.join(reason)}")
    over_copy = [r for r in run.results if r.pct_copy is not None and _shown_pct(r.pct_copy) > 100]
    if over_copy:
        named = [f"{_row(r)} {_shown_pct(r.pct_copy)}%" for r in over_copy]
        notes.append(
            f"above 100% of copy ({_more(named)}): opforge moved its bytes in less time than torch's copy "
            f"kernel moves as many at this size, so that copy is not a hard limit there"
        )
    return notes
