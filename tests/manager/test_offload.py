"""CPU offload in the background manager: a request cancelled, or hard-stopped, while it is swapped out to
the host tier gets its one final result and frees its host pages; `stats()` counts the swaps.

The manager thread is held (inside `Engine.step`, right after the first swap-out) while the test acts,
so the request is known to be swapped out when the cancel / stop arrives.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

import pytest

from tests.support.models import tiny_llama_without_eos
from tests.support.prompts import prompts_of_lengths
from tests.support.reference import greedy_reference
from tests.support.threads import TIMEOUT
from transformers_cb import ContinuousBatchingConfig, ContinuousBatchingManager, RequestStatus
from transformers_cb.engine.engine import Engine

MAX_NEW = 12
PROMPTS = prompts_of_lengths([20, 26, 23, 30], seed=5)
CONFIG = ContinuousBatchingConfig(page_size=4, num_blocks=16, max_batch_tokens=32, cpu_offload_space=None)


@pytest.fixture(scope="module")
def model():
    return tiny_llama_without_eos(seed=1)


@pytest.fixture(scope="module")
def references(model) -> list[list[int]]:
    return [greedy_reference(model, prompt, MAX_NEW) for prompt in PROMPTS]


@contextmanager
def held_after_first_swap_out() -> Iterator[tuple[threading.Event, threading.Event, list[Engine]]]:
    """(swapped, release, engines): the loop thread waits in its step once a request is swapped out."""
    swapped, release = threading.Event(), threading.Event()
    engines: list[Engine] = []
    original = Engine.step

    def step(self):
        result = original(self)
        if self.offload is not None and self.offload.num_swapped_out and not swapped.is_set():
            engines.append(self)
            swapped.set()
            release.wait(TIMEOUT)
        return result

    with mock.patch.object(Engine, "step", step):
        yield swapped, release, engines


def _start(model):
    manager = model.init_continuous_batching(continuous_batching_config=CONFIG)
    ids = [manager.add_request(p, request_id=f"r{i}", max_new_tokens=MAX_NEW) for i, p in enumerate(PROMPTS)]
    manager.start()
    return manager, ids


@contextmanager
def one_request_swapped_out(
    model,
) -> Iterator[tuple[ContinuousBatchingManager, list[str], Engine, str, threading.Event]]:
    """(manager, ids, engine, victim, release): a started manager whose loop waits in its step right after
    the first swap-out (of `victim`) until `release` is set; hard-stopped and destroyed afterwards."""
    with held_after_first_swap_out() as (swapped, release, engines):
        manager, ids = _start(model)
        try:
            assert swapped.wait(TIMEOUT), "no request was swapped out"
            (engine,) = engines
            (victim,) = list(engine.offload.swapped)
            yield manager, ids, engine, victim, release
        finally:
            release.set()
            manager.stop(hard_stop=True, timeout=TIMEOUT)
            manager.destroy()


def _finals(manager, count: int) -> dict:
    finals = {}
    while len(finals) < count:
        output = manager.get_result(timeout=TIMEOUT)
        assert output is not None, f"only {sorted(finals)} finished"
        if output.is_finished():
            assert output.request_id not in finals
            finals[output.request_id] = output
    return finals


def test_cancel_while_swapped_out(model, references) -> None:
    with one_request_swapped_out(model) as (manager, ids, engine, victim, release):
        manager.cancel_request(victim)
        release.set()
        finals = _finals(manager, len(ids))
        manager.stop(block=True, timeout=TIMEOUT)
        stats = manager.stats()
    assert finals[victim].status == RequestStatus.CANCELLED
    index = ids.index(victim)
    assert finals[victim].generated_tokens == references[index][: len(finals[victim].generated_tokens)]
    for i, rid in enumerate(ids):
        if rid != victim:
            assert (
                finals[rid].status == RequestStatus.FINISHED and finals[rid].generated_tokens == references[i]
            )
    engine.check_integrity()
    assert engine.offload.host.num_used_pages == 0 and engine.num_used_pages == 0
    assert stats.swap_out_pages > 0 and stats.swapped_out == 0 and stats.cancelled == 1


def test_hard_stop_while_swapped_out(model, references) -> None:
    with one_request_swapped_out(model) as (manager, ids, engine, victim, release):
        assert manager.stats().swapped_out == 1
        manager.stop(hard_stop=True, block=False)
        release.set()
        finals = _finals(manager, len(ids))
        manager.join(0.0, timeout=TIMEOUT)
    assert finals[victim].status == RequestStatus.FAILED and "hard-stopped" in finals[victim].error
    for i, rid in enumerate(ids):
        assert finals[rid].generated_tokens == references[i][: len(finals[rid].generated_tokens)]
    engine.check_integrity()
    assert engine.offload.host.num_used_pages == 0 and engine.num_used_pages == 0


def test_stats_count_swaps_and_no_recompute(model, references) -> None:
    manager = model.init_continuous_batching(continuous_batching_config=CONFIG)
    manager.start()
    try:
        ids = [manager.add_request(p, max_new_tokens=MAX_NEW) for p in PROMPTS]
        finals = _finals(manager, len(ids))
        stats = manager.stats()
    finally:
        manager.stop(hard_stop=True, timeout=TIMEOUT)
        manager.destroy()
    assert [finals[rid].generated_tokens for rid in ids] == references
    assert stats.preemptions > 0 and stats.swap_out_pages == stats.swap_in_pages > 0
    assert stats.recomputed_tokens == 0 and stats.swapped_out == 0
