"""ContinuousBatchingManager stop, hard stop and destroy: graceful stop completes queued and active
requests, non-blocking stop and restart, hard stop fails what is pending or running, destroy is final."""

from __future__ import annotations

import logging

import pytest

from tests.support.manager import (
    MANAGER_LOGGER,
    PROMPTS,
    assert_finished_like_generate,
    collect,
)
from tests.support.threads import TIMEOUT, wait_for
from transformers_cb import (
    RequestStatus,
)


def test_graceful_stop_completes_queued_and_active_requests(manager, ref, caplog):
    manager.start()
    ids = manager.add_requests(PROMPTS[:5], max_new_tokens=5)
    manager.stop()
    assert not manager.is_running()
    results = collect(manager, ids, timeout=TIMEOUT)
    for rid, prompt in zip(ids, PROMPTS, strict=False):
        assert_finished_like_generate(results[rid], ref, prompt, 5)
    with caplog.at_level(logging.WARNING, logger=MANAGER_LOGGER):
        assert manager.add_request(PROMPTS[0], max_new_tokens=3) is None
    assert "refused" in caplog.text
    assert manager.add_requests(PROMPTS[:2], max_new_tokens=3) is None
    assert manager.get_result(timeout=0.1) is None
    manager.engine.check_integrity()
    assert manager.engine.num_used_pages == 0

    manager.start()  # a new session on the same manager
    rid = manager.add_request(PROMPTS[6], max_new_tokens=5)
    assert rid is not None and rid not in ids
    assert_finished_like_generate(manager.get_result(timeout=TIMEOUT), ref, PROMPTS[6], 5)


def test_non_blocking_stop_returns_and_the_thread_ends(manager, ref):
    manager.start()
    rid = manager.add_request(PROMPTS[0], max_new_tokens=4)
    manager.stop(block=False)
    wait_for(lambda: not manager.is_running(), what="the thread to end")
    assert_finished_like_generate(manager.get_result(rid, timeout=TIMEOUT), ref, PROMPTS[0], 4)


def test_start_right_after_a_non_blocking_stop_starts_a_new_session(manager, ref):
    manager.start()
    first = manager.add_request(PROMPTS[0], max_new_tokens=8)
    manager.stop(block=False)  # the thread is still draining `first`
    manager.start()
    assert manager.is_running()
    second = manager.add_request(PROMPTS[1], max_new_tokens=3)
    assert second is not None, "start() after stop() accepts submissions again"
    results = collect(manager, [first, second])
    assert_finished_like_generate(results[first], ref, PROMPTS[0], 8)
    assert_finished_like_generate(results[second], ref, PROMPTS[1], 3)
    assert manager.is_running()


def test_hard_stop_fails_pending_and_running_requests(manager):
    manager.start()
    running = [manager.add_request(p, max_new_tokens=400) for p in PROMPTS[:2]]
    wait_for(lambda: manager.engine.counters.generated_tokens >= 2, what="requests to run")
    with manager.pause():
        pending = manager.add_request(PROMPTS[2], max_new_tokens=5)
        manager.stop(hard_stop=True)
    assert not manager.is_running()
    results = collect(manager, [*running, pending], timeout=TIMEOUT)
    for output in results.values():
        assert output.status == RequestStatus.FAILED
        assert "RuntimeError" in output.error
    assert results[pending].generated_tokens == []
    assert manager.get_result(timeout=0.1) is None
    manager.engine.check_integrity()
    assert manager.engine.num_used_pages == 0
    assert manager.stats().failed == 3


def test_hard_stop_of_a_manager_never_started_fails_its_queue(manager):
    ids = manager.add_requests(PROMPTS[:3], max_new_tokens=3)
    manager.stop(hard_stop=True)
    results = collect(manager, ids, timeout=TIMEOUT)
    assert {o.status for o in results.values()} == {RequestStatus.FAILED}
    assert all("RuntimeError" in o.error for o in results.values())


def test_destroy_then_start_raises(manager):
    manager.start()
    manager.destroy()
    assert not manager.is_running()
    assert manager.engine is None
    with pytest.raises(RuntimeError, match="destroyed and cannot be restarted"):
        manager.start()
    with pytest.raises(RuntimeError, match="destroyed"):
        manager.add_request(PROMPTS[0], max_new_tokens=2)
    manager.destroy()  # twice is harmless
