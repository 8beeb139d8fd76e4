"""`manager/stats.py`: `ManagerStats` built from the shared state and the engine's one `snapshot()`."""

from __future__ import annotations

from transformers import GenerationConfig

from tests.support.models import tiny_llama
from transformers_cb import ContinuousBatchingConfig, ManagerStats
from transformers_cb.engine.build import build_engine
from transformers_cb.manager.state import ManagerState
from transformers_cb.manager.stats import ThroughputWindow, snapshot
from transformers_cb.requests import RequestStatus

# ManagerStats fields copied as they are from the engine's snapshot.
COPIED = (
    "running",
    "preemptions",
    "pages_in_use",
    "pages_total",
    "pages_in_use_by_group",
    "prefix_cache_pages",
    "prefix_cache_evictions",
    "recomputed_tokens",
    "swapped_out",
    "swap_out_pages",
    "swap_in_pages",
    "compiled_graphs",
)


def test_a_released_engine_reads_as_zeros() -> None:
    state = ManagerState(engine=None)
    state.counts[RequestStatus.CANCELLED] = 2
    stats = snapshot(state, ThroughputWindow())
    assert isinstance(stats, ManagerStats)
    assert stats.cancelled == 2 and stats.queued == stats.running == stats.pages_total == 0


def test_every_engine_figure_reaches_the_snapshot() -> None:
    engine = build_engine(
        tiny_llama(), GenerationConfig(do_sample=False), ContinuousBatchingConfig(page_size=16, num_blocks=8)
    )
    figures = engine.snapshot()
    assert figures.pages_total == engine.num_total_pages > 0
    stats = snapshot(ManagerState(engine=engine), ThroughputWindow())
    for name in COPIED:
        assert getattr(stats, name) == getattr(figures, name), name
    assert stats.queued == figures.waiting
    assert stats.prefill_tokens == figures.counters.prefill_tokens
    assert stats.decode_tokens == figures.counters.decode_tokens
    assert stats.prefix_cache_hit_rate == figures.prefix.hit_rate
    assert stats.prefix_cache_hit_tokens == figures.prefix.hit_tokens
