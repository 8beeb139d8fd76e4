"""`RecomputeCounter` (scheduler/recompute.py): the tokens preemption made the scheduler run a second time."""

from __future__ import annotations

from transformers_cb.scheduler.recompute import RecomputeCounter


def test_recomputed_tokens_count_what_runs_again() -> None:
    """Counted as they run: a request dropped at 10 computed tokens that re-runs [0, 6) then [6, 12) counts
    10; one dropped again before catching up keeps its older, larger mark; a cancelled one is forgotten."""
    counter = RecomputeCounter()
    counter.dropped("a", 10)
    counter.ran("a", 0, 6)
    assert (counter.total, counter.pending) == (6, {"a": 10})
    counter.ran("a", 6, 12)
    assert (counter.total, counter.pending) == (10, {})
    counter.dropped("b", 8)
    counter.ran("b", 4, 6)  # a prefix-cache hit skipped [0, 4)
    counter.dropped("b", 6)
    assert counter.pending == {"b": 8}
    counter.forget("b")
    counter.ran("b", 0, 8)
    assert counter.total == 12 and not counter.pending
    counter.dropped("c", 0)
    assert not counter.pending
