"""Fixed model-level layout timings for optimize's tests: the decisions they lead to, not the host's."""

from opforge import optimize_layout


def mocked_layout_timings(monkeypatch, pairs) -> None:
    """The model-level timings (``_interleaved_us``) answer ``pairs`` in turn, each (channels_last
    inside, NCHW) in microseconds, and no choice cached by an earlier test is found."""
    answers = iter(pairs)
    monkeypatch.setattr(optimize_layout, "_interleaved_us", lambda *args, **kwargs: next(answers))
    monkeypatch.setattr(optimize_layout, "_timings", {})
