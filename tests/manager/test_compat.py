"""The built-in manager's public attributes that transformers' own continuous-batching tests reach:
`logit_processor` (with `.clear()`), `batch_processor` (`.cache`, `.has_pending_requests()`),
`current_batch`, `output_router.output_queue`, with the built-in's meaning (manager/compat.py)."""

from __future__ import annotations

import queue

import pytest
from transformers import GenerationConfig

from tests.support.manager import PROMPTS, assert_finished_like_generate, new_manager
from tests.support.threads import TIMEOUT


def test_batch_processor_lives_with_the_session(manager, ref):
    assert manager.batch_processor is None  # as the built-in: created when the loop starts
    manager.start()
    processor = manager.batch_processor
    assert processor is not None
    assert processor.cache.block_size == manager.engine.cache.page_size
    assert processor.cache.num_blocks == manager.stats().pages_total
    assert processor.cache.compute_free_capacity() == 1.0
    with manager.pause():
        request_id = manager.add_request(PROMPTS[0], max_new_tokens=3)
        assert processor.has_pending_requests()
    assert_finished_like_generate(manager.get_result(request_id, timeout=TIMEOUT), ref, PROMPTS[0], 3)
    assert not processor.has_pending_requests()
    assert manager.current_batch >= 3  # one prefill, two decodes at least
    manager.stop()
    assert manager.batch_processor is None


def test_current_batch_counts_the_steps_of_this_session(manager):
    manager.start()
    manager.get_result(manager.add_request(PROMPTS[1], max_new_tokens=4), timeout=TIMEOUT)
    # A 1-token prefill (budget permitting, one step) then 3 decodes; the loop steps only with work.
    assert 4 <= manager.current_batch <= 4 + len(PROMPTS[1])
    manager.stop()
    manager.start()
    assert manager.current_batch == 0  # reset per session, as the built-in's


def test_output_queue_is_the_shared_queue(manager, ref):
    output_queue = manager.output_router.output_queue
    assert output_queue.empty()
    manager.start()
    first = manager.add_request(PROMPTS[0], max_new_tokens=2)
    second = manager.add_request(PROMPTS[1], max_new_tokens=2)
    manager.stop()  # graceful: both finished and waiting in the shared queue
    assert output_queue.qsize() == 2
    taken = output_queue.get(timeout=TIMEOUT)
    assert taken.request_id == first
    output_queue.put(taken)  # what the built-in's get_result does with another request's output
    assert [manager.get_result(timeout=1).request_id for _ in range(2)] == [second, first]
    assert output_queue.empty()
    with pytest.raises(queue.Empty):
        output_queue.get_nowait()


def test_logit_processor_clear_drops_the_processors(model):
    config = GenerationConfig(do_sample=False, repetition_penalty=3.0, max_new_tokens=6, eos_token_id=None)
    plain = new_manager(model)
    penalized = model.init_continuous_batching(generation_config=config)
    cleared = model.init_continuous_batching(generation_config=config)
    assert list(penalized.logit_processor) == ["repetition_penalty"]
    cleared.logit_processor.clear()
    assert len(cleared.logit_processor) == 0 and not cleared.logit_processor.do_processing
    prompt = [5, 5, 5, 6, 6]
    results = {}
    for name, manager in (("plain", plain), ("penalized", penalized), ("cleared", cleared)):
        manager.start()
        results[name] = manager.get_result(manager.add_request(prompt, max_new_tokens=6), timeout=TIMEOUT)
        manager.stop()
        manager.destroy()
    assert results["cleared"].generated_tokens == results["plain"].generated_tokens
    assert results["penalized"].generated_tokens != results["plain"].generated_tokens
    assert results["cleared"].status == results["plain"].status
