"""ContinuousBatchingManager submissions and cancellation: ids (given, generated, duplicate, reused), bad
submissions refused while the manager keeps serving, requests that never fit, the queue limit,
`add_requests`, and cancelling pending, paused, running, unknown and finished requests."""

from __future__ import annotations

import logging
import queue

import pytest
import torch

from tests.support.manager import (
    MANAGER_LOGGER,
    PROMPTS,
    assert_finished_like_generate,
    assert_no_leak,
    collect,
    new_manager,
)
from tests.support.threads import TIMEOUT, run_with_timeout, wait_for
from transformers_cb import (
    RequestStatus,
)


# -- submissions ------------------------------------------------------------------------------
def test_add_request_returns_the_id_and_output_matches_generate(manager, ref):
    manager.start()
    rid = manager.add_request(PROMPTS[2], request_id="mine", max_new_tokens=6)
    assert rid == "mine"
    auto = manager.add_request(torch.tensor(PROMPTS[3]), max_new_tokens=6)  # 1D tensors are accepted
    assert isinstance(auto, str) and auto != rid
    results = collect(manager, [rid, auto])
    assert_finished_like_generate(results[rid], ref, PROMPTS[2], 6)
    assert_finished_like_generate(results[auto], ref, PROMPTS[3], 6)
    assert results[rid].finish_reason == "length"
    assert_no_leak(manager)


def test_auto_generated_ids_are_unique(manager):
    explicit = [manager.add_request(PROMPTS[0], request_id=f"req_{i}", max_new_tokens=1) for i in (0, 2)]
    auto = [manager.add_request(PROMPTS[0], max_new_tokens=1) for _ in range(20)]
    ids = explicit + auto
    assert len(set(ids)) == len(ids)
    manager.start()
    assert set(collect(manager, ids)) == set(ids)


def test_duplicate_live_id_is_rejected_but_a_finished_id_can_be_reused(manager, ref):
    manager.add_request(PROMPTS[0], request_id="dup", max_new_tokens=3)
    with pytest.raises(ValueError, match="already in use"):
        manager.add_request(PROMPTS[1], request_id="dup", max_new_tokens=3)
    manager.start()
    assert_finished_like_generate(manager.get_result(timeout=TIMEOUT), ref, PROMPTS[0], 3)
    assert manager.add_request(PROMPTS[1], request_id="dup", max_new_tokens=3) == "dup"
    output = manager.get_result(request_id="dup", timeout=TIMEOUT)
    assert_finished_like_generate(output, ref, PROMPTS[1], 3)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"input_ids": []}, "empty prompt"),
        ({"input_ids": [5, 300]}, "outside the vocabulary"),
        ({"input_ids": [5, -1]}, "outside the vocabulary"),
        ({"input_ids": "hello"}, "expected a list of token ids"),
        ({"input_ids": [5, 6], "max_new_tokens": 0}, "max_new_tokens must be >= 1"),
        ({"input_ids": [5, 6], "max_new_tokens": -3}, "max_new_tokens must be >= 1"),
        ({"input_ids": [5] * 500, "max_new_tokens": 20}, "max_position_embeddings"),
        ({"input_ids": [5, 6], "request_id": 7}, "request_id must be a str"),
    ],
    ids=["empty", "oov", "negative-id", "str", "zero-new", "negative-new", "too-long", "id-type"],
)
def test_bad_submission_raises_and_the_manager_keeps_serving(manager, ref, kwargs, match):
    manager.start()
    kwargs.setdefault("max_new_tokens", 4)
    with pytest.raises(ValueError, match=match):
        manager.add_request(**kwargs)
    assert manager.is_running()
    rid = manager.add_request(PROMPTS[0], max_new_tokens=4)
    assert_finished_like_generate(manager.get_result(rid, timeout=TIMEOUT), ref, PROMPTS[0], 4)
    assert manager.stats().failed == 0


def test_request_that_can_never_fit_the_cache_is_rejected(model, ref):
    manager = new_manager(model, num_blocks=2)  # 2 pages of 16 tokens
    try:
        manager.start()
        with pytest.raises(ValueError, match="KV pages"):
            manager.add_request(list(range(3, 23)), max_new_tokens=20)
        rid = manager.add_request(PROMPTS[0], max_new_tokens=4)
        assert_finished_like_generate(manager.get_result(rid, timeout=TIMEOUT), ref, PROMPTS[0], 4)
    finally:
        manager.destroy()


def test_max_queue_size_raises_queue_full(model, ref):
    manager = new_manager(model, max_queue_size=2)
    try:
        ids = [manager.add_request(p, max_new_tokens=3) for p in PROMPTS[:2]]
        with pytest.raises(queue.Full):
            manager.add_request(PROMPTS[2], max_new_tokens=3)
        manager.start()
        results = collect(manager, ids)
        for rid, prompt in zip(ids, PROMPTS, strict=False):
            assert_finished_like_generate(results[rid], ref, prompt, 3)
        rid = manager.add_request(PROMPTS[2], max_new_tokens=3)  # room again
        assert_finished_like_generate(manager.get_result(rid, timeout=TIMEOUT), ref, PROMPTS[2], 3)
    finally:
        manager.destroy()


def test_add_requests_returns_ids_in_input_order(manager, ref):
    manager.start()
    ids = manager.add_requests(PROMPTS[:5], max_new_tokens=5)
    assert len(ids) == 5 and len(set(ids)) == 5
    results = collect(manager, ids)
    for rid, prompt in zip(ids, PROMPTS, strict=False):
        assert_finished_like_generate(results[rid], ref, prompt, 5)


def test_add_requests_error_names_the_index(manager, ref):
    with pytest.raises(ValueError, match=r"inputs\[1\].*empty prompt"):
        manager.add_requests([PROMPTS[0], [], PROMPTS[1]], max_new_tokens=3)
    with pytest.raises(ValueError, match=r"inputs\[2\].*outside the vocabulary"):
        manager.add_requests([PROMPTS[0], PROMPTS[1], [1, 2, 999]], max_new_tokens=3)
    manager.start()
    # Whatever was accepted before the bad input is still served; nothing else is affected.
    for output in run_with_timeout(lambda: list(manager)):
        assert output.status == RequestStatus.FINISHED
    rid = manager.add_request(PROMPTS[2], max_new_tokens=3)
    assert_finished_like_generate(manager.get_result(rid, timeout=TIMEOUT), ref, PROMPTS[2], 3)


# -- cancellation -----------------------------------------------------------------------------
def test_cancel_pending_request_before_start(manager, ref):
    rid = manager.add_request(PROMPTS[0], max_new_tokens=5)
    keep = manager.add_request(PROMPTS[1], max_new_tokens=5)
    manager.cancel_request(rid)
    output = manager.get_result(timeout=TIMEOUT)
    assert output.request_id == rid
    assert output.status == RequestStatus.CANCELLED
    assert output.generated_tokens == []
    engine = manager.engine
    engine.check_integrity()
    assert engine.num_used_pages == 0
    manager.start()
    assert_finished_like_generate(manager.get_result(timeout=TIMEOUT), ref, PROMPTS[1], 5)
    assert manager.get_result(timeout=0.2) is None, "exactly one final result for the cancelled request"
    assert manager.stats().cancelled == 1
    assert keep != rid


def test_cancel_pending_request_while_paused(manager, ref):
    manager.start()
    with manager.pause():
        rid = manager.add_request(PROMPTS[0], max_new_tokens=5)
        other = manager.add_request(PROMPTS[1], max_new_tokens=5)
        manager.cancel_request(rid)
    results = collect(manager, [rid, other])
    assert results[rid].status == RequestStatus.CANCELLED
    assert results[rid].generated_tokens == []
    assert_finished_like_generate(results[other], ref, PROMPTS[1], 5)
    assert manager.get_result(timeout=0.2) is None
    assert_no_leak(manager)


def test_cancel_running_request_frees_its_pages(manager, ref):
    manager.start()
    long_id = manager.add_request(PROMPTS[4], max_new_tokens=400)
    short_id = manager.add_request(PROMPTS[5], max_new_tokens=6)
    wait_for(lambda: manager.engine.counters.generated_tokens >= 4, what="the long request to run")
    with manager.pause():
        assert manager.engine.num_used_pages > 0
        manager.cancel_request(long_id)
    results = collect(manager, [long_id, short_id])
    cancelled = results[long_id]
    assert cancelled.status == RequestStatus.CANCELLED
    assert 0 < len(cancelled.generated_tokens) < 400
    assert cancelled.generated_tokens == ref(PROMPTS[4], len(cancelled.generated_tokens))
    assert_finished_like_generate(results[short_id], ref, PROMPTS[5], 6)
    assert manager.get_result(timeout=0.2) is None
    assert_no_leak(manager)
    assert manager.stats().cancelled == 1


def test_cancel_unknown_or_finished_id_logs_a_warning(manager, ref, caplog):
    manager.start()
    with caplog.at_level(logging.WARNING, logger=MANAGER_LOGGER):
        manager.cancel_request("never-submitted")
    assert "never-submitted" in caplog.text
    rid = manager.add_request(PROMPTS[0], max_new_tokens=2)
    assert_finished_like_generate(manager.get_result(timeout=TIMEOUT), ref, PROMPTS[0], 2)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=MANAGER_LOGGER):
        manager.cancel_request(rid)
    assert rid in caplog.text
    assert manager.is_running()
