"""ContinuousBatchingManager pause: the loop is held with requests in flight, weights changed during a pause
are used by new requests, pausing a manager that is not running does not block."""

from __future__ import annotations

import time

import torch

from tests.support.manager import (
    PROMPTS,
    assert_finished_like_generate,
    assert_no_leak,
    collect,
    make_model,
)
from tests.support.reference import greedy_reference
from tests.support.threads import TIMEOUT, run_with_timeout, wait_for
from transformers_cb import (
    RequestStatus,
)


def test_pause_holds_the_loop_and_keeps_in_flight_requests(manager, ref):
    manager.start()
    ids = manager.add_requests(PROMPTS[:2], max_new_tokens=24)
    engine = manager.engine
    wait_for(lambda: engine.counters.steps >= 2, what="a few steps")
    with manager.pause():
        steps, used = engine.counters.steps, engine.num_used_pages
        running = [r.request_id for r in engine.scheduler.running]
        time.sleep(0.3)
        assert engine.counters.steps == steps, "no step runs while paused"
        assert engine.num_used_pages == used > 0
        assert sorted(running) == sorted(ids), "in-flight requests are kept"
        engine.check_integrity()
        with torch.no_grad():
            manager.model.lm_head.weight.mul_(1.0)  # an in-place weight update
        assert manager.is_running()
    results = collect(manager, ids)
    for rid, prompt in zip(ids, PROMPTS, strict=False):
        assert_finished_like_generate(results[rid], ref, prompt, 24)
    assert_no_leak(manager)


def test_weights_updated_during_pause_are_used_by_new_requests(manager, model, ref):
    new_weights = make_model(seed=1)
    manager.start()
    rid = manager.add_request(PROMPTS[0], max_new_tokens=5)
    assert_finished_like_generate(manager.get_result(rid, timeout=TIMEOUT), ref, PROMPTS[0], 5)
    with manager.pause(), torch.no_grad():
        for param, new in zip(model.parameters(), new_weights.parameters(), strict=True):
            param.copy_(new)
    rid = manager.add_request(PROMPTS[0], max_new_tokens=5)
    output = manager.get_result(rid, timeout=TIMEOUT)
    assert output.status == RequestStatus.FINISHED
    assert output.generated_tokens == greedy_reference(new_weights, PROMPTS[0], 5)
    assert output.generated_tokens != ref(PROMPTS[0], 5)


def test_pause_of_a_manager_not_running_does_not_block(manager):
    def pause_briefly() -> None:
        with manager.pause():
            pass

    run_with_timeout(pause_briefly)
