"""The bench's noise notes: busy-machine warnings and the floor notes under its table."""

import dataclasses

import pytest

from opforge.bench import harness, noise, report


def _fake_run(
    *,
    load_start=None,
    load_end=None,
    env=None,
    p20=1.0,
    p80=1.1,
    pct_floor=50.0,
    nbytes=8 << 20,
    device="cpu",
    cache=32 << 20,
    copy_ms=None,
    status="ok",
):
    """A one-row run with the given load averages, eager timing spread and opforge % of floor."""

    def prov(name, p20_ms, p80_ms, pct, st="ok"):
        return harness.ProviderResult(name, st, 1.0, p20_ms, p80_ms, None, 10.0, pct)

    res = harness.CaseResult(
        "add_relu",
        "add_relu",
        "N=2^20",
        "float32",
        "fwd",
        nbytes,
        0.0,
        4,
        {
            "opforge": prov("opforge", 1.0, 1.1, pct_floor),
            "eager": prov("slow_add", p20, p80, 20.0, status),
        },
        copy_ms=copy_ms,
    )
    environment = {
        "cpu": "X",
        "cpu_cores": 2,
        "usable_cores": 2,
        "cpu_isa": "AVX2",
        "opforge": "0",
        "torch": "0",
        "cuda": None,
        "gpu": "G",
        "date_utc": "-",
        "git_commit": None,
        "load_avg_1m_start": load_start,
        "load_avg_1m": load_end,
        **(env or {}),
    }
    return harness.Run(harness.Settings(device=device), environment, 20.0, cache, [res])


@pytest.mark.parametrize(
    "start, end, env, expect",
    [
        (1.0, 1.9, None, None),  # within the two cores
        (2.0, 2.0, None, None),  # at the core count is not above it
        (2.5, 1.0, None, "load average 2.5 at the start of the run, above its 2 cores"),
        (0.5, 3.1, None, "load average 3.1 at the end of the run, above its 2 cores"),
        (4.0, 3.9, None, "load average 4.0 at the start and 3.9 at the end"),
        (1.5, None, {"usable_cores": 1, "cpu_cores": 8}, "1.5 at the start of the run, above its 1 cores"),  # affinity
        (None, 2.5, {"usable_cores": None}, "2.5 at the end"),  # a run saved before usable_cores: all the cores
        (None, None, None, None),  # no load average on this platform
    ],
)
def test_busy_warning_from_load_average(start, end, env, expect):
    run = _fake_run(load_start=start, load_end=end, env=env)
    warning = noise.busy_warning(run)
    text, md = report.table(run), report.markdown(run)
    if expect is None:
        assert warning is None and "busy" not in text and "busy" not in md
        return
    assert expect in warning and warning.startswith("warning: busy machine: load average") and "\n" not in warning
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("op "))
    assert lines[1] == warning  # before the table, under the summary line
    assert lines.index(warning, header) > header  # and again in the notes below it
    assert md.count(warning) == 2


@pytest.mark.parametrize(
    "p20, p80, status, warned",
    [
        (1.0, 1.4, "ok", False),
        (1.0, 1.5, "ok", False),  # the limit itself passes
        (1.0, 1.6, "ok", True),
        (0.5, 2.0, "ok", True),
        (1.0, None, "WRONG", False),  # a provider that was not timed has no spread
    ],
)
def test_busy_warning_from_timing_spread(p20, p80, status, warned):
    run = _fake_run(p20=p20, p80=p80, status=status)
    warning = noise.busy_warning(run)
    if not warned:
        assert warning is None
        assert not noise.spreads(run)
        return
    assert (
        "warning: unsteady timings: p80/p20 above 1.5 in 1 of 1 rows "
        f"(worst {p80 / p20:.2f}, add_relu N=2^20 float32 fwd eager)" in warning
    )
    assert "busy" not in warning and "load average" not in warning  # the load was fine
    assert report.table(run).count(warning) == 2


@pytest.mark.parametrize(
    "pct, shown", [(50.0, "50%"), (100.0, "100%"), (100.4, "100%"), (100.6, "101%"), (194.0, "194%")]
)
def test_above_the_floor_note_appears_exactly_above_100(pct, shown):
    run = _fake_run(pct_floor=pct)
    assert report.rows(run)[1][0][12] == shown
    notes = noise.floor_notes(run)
    assert notes[0].startswith("% floor = floor time / opforge's time") and "20.0 GB/s" in notes[0]
    over = [n for n in notes if n.startswith("above 100% of the floor")]
    assert bool(over) == (int(shown[:-1]) > 100)
    if over:
        assert f"add_relu N=2^20 float32 fwd {shown}" in over[0]
        assert "it moves at most 8 MiB per call, within the 32 MiB last-level cache" in over[0]
        assert "write-allocate" in over[0]  # the CPU's copy floor is low as well
        assert over[0] in report.table(run)


def test_above_the_floor_reason_follows_the_case():
    big = noise.floor_notes(_fake_run(pct_floor=120.0, nbytes=96 << 20))  # bigger than the cache
    (over,) = [n for n in big if n.startswith("above 100%")]
    assert "within the" not in over and "write-allocate" in over
    gpu = noise.floor_notes(_fake_run(pct_floor=103.0, nbytes=96 << 20, device="cuda"))
    assert "it moves more than the cache holds: an op that reads more than it writes" in gpu[-1]
    assert "write-allocate" not in gpu[-1] and "within the" not in gpu[-1]
    small_gpu = noise.floor_notes(_fake_run(pct_floor=103.0, device="cuda"))  # 8 MiB, in a 32 MiB L2
    assert "within the 32 MiB last-level cache" in small_gpu[-1] and "more than the cache" not in small_gpu[-1]
    mixed = _fake_run(pct_floor=103.0, device="cuda")  # two rows over the floor, one in the cache and one not
    mixed.results.append(dataclasses.replace(mixed.results[0], shape="N=2^26", bytes=96 << 20))
    (over,) = [n for n in noise.floor_notes(mixed) if n.startswith("above 100%")]
    assert "N=2^20 float32 fwd 103%, add_relu N=2^26 float32 fwd 103%" in over
    assert "1 of them move at most 8 MiB" in over and "1 of them move more than the cache holds" in over
    compute_bound = _fake_run(pct_floor=None)  # TFLOP/s rows have no floor: nothing to explain
    assert noise.floor_notes(compute_bound) == [] and "% floor =" not in report.table(compute_bound)


@pytest.mark.parametrize("copy_ms, noted", [(0.8, False), (1.0, False), (1.3, True)])
def test_above_a_same_size_copy_is_explained(copy_ms, noted):
    run = _fake_run(copy_ms=copy_ms, device="cuda")  # opforge's median is 1.0 ms
    note = [n for n in noise.floor_notes(run) if n.startswith("above 100% of copy")]
    assert bool(note) == noted
    if noted:
        assert "add_relu N=2^20 float32 fwd 130%" in note[0]
