"""`manager/stats.py`: `ManagerStats` snapshots built from the shared state and the engine's figures."""

from __future__ import annotations

import dataclasses

from transformers import GenerationConfig

from tests.helpers import tiny_llama
from transformers_cb import ContinuousBatchingConfig, ManagerStats
from transformers_cb.engine.engine import Engine
from transformers_cb.manager.state import ManagerState
from transformers_cb.manager.stats import EngineFigures, ThroughputWindow, engine_figures, snapshot
from transformers_cb.requests import RequestStatus


def test_a_released_engine_reads_as_zeros() -> None:
    assert engine_figures(None) == EngineFigures()
    state = ManagerState(engine=None)
    state.counts[RequestStatus.CANCELLED] = 2
    stats = snapshot(state, ThroughputWindow())
    assert isinstance(stats, ManagerStats)
    assert stats.cancelled == 2 and stats.queued == stats.running == stats.pages_total == 0


def test_every_engine_figure_reaches_the_snapshot() -> None:
    engine = Engine(
        tiny_llama(), GenerationConfig(do_sample=False), ContinuousBatchingConfig(page_size=16, num_blocks=8)
    )
    figures = engine_figures(engine)
    assert figures.pages_total == engine.cache.num_total_pages > 0
    stats = snapshot(ManagerState(engine=engine), ThroughputWindow())
    for name in (f.name for f in dataclasses.fields(EngineFigures) if f.name != "waiting"):
        assert getattr(stats, name) == getattr(figures, name), name
