"""`release_cache()` / `resume_cache()` (issue 47, item 4; docs/manager.md, "Releasing the cache"): the cache's
memory given back while a trainer trains (the process's RSS drops by the device cache's bytes), the model
plain again in between (a training forward and backward run on it), requests in flight or submitted in
between run after the resume with `generate()`'s tokens, a change of the weights while released is a new
weight version."""

from __future__ import annotations

import os

import pytest
import torch

from tests.support.manager import collect
from tests.support.models import sharpen_attention, tiny_llama
from tests.support.prompts import prompts_of_lengths
from tests.support.reference import greedy_reference
from tests.support.threads import TIMEOUT, call_in_thread, wait_for
from transformers_cb import ContinuousBatchingConfig, RequestStatus
from transformers_cb.runner.products.packed_linear import RULE_ENV

MAX_NEW_TOKENS = 12
PROMPTS = prompts_of_lengths([9, 14, 5], seed=7)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _touch_every_page(tensors: list) -> None:
    for tensor in tensors:  # no reference stays behind (a loop variable in the test would hold the last)
        tensor.mul_(1)


def _model():
    return sharpen_attention(tiny_llama())


def _manager(model, **config):
    return model.init_continuous_batching(
        continuous_batching_config=ContinuousBatchingConfig(page_size=16, **config)
    )


def _expected(model) -> list[list[int]]:
    return [greedy_reference(model, p, MAX_NEW_TOKENS) for p in PROMPTS]


def _tokens(outputs, ids) -> list[list[int]]:
    assert all(outputs[rid].status == RequestStatus.FINISHED for rid in ids)
    return [outputs[rid].generated_tokens for rid in ids]


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the RSS from /proc")
def test_release_gives_the_cache_memory_back_and_resume_rebuilds_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(RULE_ENV, "all")  # packed copies of every Linear: freed too
    model = _model()
    manager = _manager(model, num_blocks=1024)  # 1024 pages of 16 tokens x 512 bytes: 8 MiB of KV
    try:
        manager.start()
        engine = manager.engine
        cache_bytes = engine.cache.nbytes()
        assert cache_bytes >= 8 << 20
        ids = manager.add_requests(PROMPTS, max_new_tokens=MAX_NEW_TOKENS)
        assert _tokens(collect(manager, ids), ids) == _expected(model)
        pack_bytes = manager.stats().packed_weight_bytes
        assert pack_bytes > 0
        # The cache's pages take memory once touched (memory/zeroed.py): touch every one, values unchanged
        _touch_every_page(engine.cache.group_tensors)
        before = _rss_bytes()
        manager.release_cache()
        assert manager.cache_released and engine.cache.nbytes() == 0
        assert manager.stats().packed_weight_bytes == 0
        dropped, held = before - _rss_bytes(), cache_bytes + pack_bytes
        assert dropped >= 0.9 * held, f"RSS dropped by {dropped} bytes, the cache and packs held {held}"
        manager.release_cache()  # a no-op
        manager.resume_cache()
        assert not manager.cache_released and engine.cache.nbytes() == cache_bytes
        ids = manager.add_requests(PROMPTS, max_new_tokens=MAX_NEW_TOKENS)
        assert _tokens(collect(manager, ids), ids) == _expected(model)
        assert manager.weight_version == 0  # nothing changed the weights
    finally:
        manager.stop(hard_stop=True, timeout=TIMEOUT)


def test_requests_in_flight_or_submitted_while_released_run_after_the_resume() -> None:
    model = _model()
    manager = _manager(model)
    try:
        manager.start()
        in_flight = manager.add_requests(PROMPTS, max_new_tokens=MAX_NEW_TOKENS)
        manager.release_cache()
        waiting = manager.add_requests(PROMPTS, max_new_tokens=MAX_NEW_TOKENS)
        with manager.pause():  # a pause while released holds at once and does not hang
            pass
        assert manager.get_result(timeout=0.3) is None  # nothing runs while released: no result comes
        assert manager.cache_released and not manager.engine.scheduler.running
        manager.resume_cache()
        outputs = collect(manager, [*in_flight, *waiting])
        expected = _expected(model)
        assert _tokens(outputs, in_flight) == expected and _tokens(outputs, waiting) == expected
    finally:
        manager.stop(hard_stop=True, timeout=TIMEOUT)


def test_a_trainer_trains_the_same_model_while_released_and_the_resume_sees_it() -> None:
    model = _model()
    manager = _manager(model)
    frozen_pointers = [p.data_ptr() for p in model.parameters()]
    try:
        manager.start()
        ids = manager.add_requests(PROMPTS, max_new_tokens=MAX_NEW_TOKENS)
        before = _tokens(collect(manager, ids), ids)
        manager.release_cache()
        # The model is plain again (its own attention, no packed forward): a training step runs on it.
        assert "paged" not in (model.config._attn_implementation or "")
        batch = torch.tensor([PROMPTS[0]])
        model.train()
        loss = -model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.optim.SGD(model.parameters(), lr=0.5).step()
        model.zero_grad()
        model.eval()
        manager.resume_cache()
        assert manager.weight_version == 1  # the change while released is a new version
        ids = manager.add_requests(PROMPTS, max_new_tokens=MAX_NEW_TOKENS)
        outputs = collect(manager, ids)
        after = _tokens(outputs, ids)
        assert after == _expected(model) and after != before
        assert all(outputs[rid].weight_version_runs == ((0, 1),) for rid in ids)
        assert [p.data_ptr() for p in model.parameters()] == frozen_pointers  # trained in place
    finally:
        manager.stop(hard_stop=True, timeout=TIMEOUT)


def test_release_on_a_manager_not_running_holds_its_next_session_until_the_resume() -> None:
    model = _model()
    manager = _manager(model)
    try:
        manager.release_cache()
        assert manager.cache_released and manager.engine.cache.nbytes() == 0
        manager.start()
        ids = manager.add_requests(PROMPTS, max_new_tokens=MAX_NEW_TOKENS)
        assert manager.get_result(timeout=0.3) is None  # held: nothing runs
        _, error = call_in_thread(manager.resume_cache, what="resume_cache()")
        assert error is None
        assert _tokens(collect(manager, ids), ids) == _expected(model)
        wait_for(lambda: not manager.cache_released, what="the cache rebuilt")
    finally:
        manager.stop(hard_stop=True, timeout=TIMEOUT)


def test_a_graceful_stop_while_released_rebuilds_and_finishes_the_queue() -> None:
    model = _model()
    manager = _manager(model)
    manager.start()
    manager.release_cache()
    ids = manager.add_requests(PROMPTS, max_new_tokens=MAX_NEW_TOKENS)
    manager.stop(timeout=TIMEOUT)
    assert _tokens(collect(manager, ids), ids) == _expected(model)
    assert not manager.cache_released


def test_a_request_stopped_mid_decode_by_the_release_ends_with_generates_tokens() -> None:
    model = _model()
    manager = _manager(model)
    long_tokens = 40
    try:
        manager.start()
        rid = manager.add_request(PROMPTS[1], max_new_tokens=long_tokens, streaming=True)
        stream = manager.request_id_iter(rid)
        first = next(stream)  # a token exists: the request holds KV
        manager.release_cache()
        assert manager.engine.cache.nbytes() == 0
        manager.resume_cache()
        outputs = [first, *stream]
        final = outputs[-1]
        assert final.status == RequestStatus.FINISHED
        assert final.generated_tokens == greedy_reference(model, PROMPTS[1], long_tokens)
        assert manager.stats().recomputed_tokens > 0  # its KV was dropped and computed again
    finally:
        manager.stop(hard_stop=True, timeout=TIMEOUT)


def test_a_result_handler_on_the_loop_thread_releases_at_the_next_step_boundary() -> None:
    """A handler runs on the manager's thread, maybe inside a step: the release is recorded there and applied
    between two steps (never with a step half applied)."""
    model = _model()
    manager = _manager(model)
    try:
        manager.start()
        first = manager.add_request(PROMPTS[0], max_new_tokens=2)
        manager.register_result_handler(first, lambda output: manager.release_cache())
        others = manager.add_requests(PROMPTS, max_new_tokens=MAX_NEW_TOKENS)
        wait_for(lambda: manager.cache_released, what="the release asked by the handler")
        assert manager.engine.cache.nbytes() == 0
        manager.resume_cache()
        assert _tokens(collect(manager, others), others) == _expected(model)
    finally:
        manager.stop(hard_stop=True, timeout=TIMEOUT)
