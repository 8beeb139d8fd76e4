"""ContinuousBatchingManager `stats()`: request, token and page counts, and preemptions, with the outputs
unchanged."""

from __future__ import annotations

import threading

from tests.support.manager import (
    PROMPTS,
    assert_finished_like_generate,
    assert_no_leak,
    collect,
    new_manager,
)
from tests.support.threads import TIMEOUT, wait_for
from transformers_cb import (
    ManagerStats,
    RequestStatus,
)


def test_stats_counts(manager, ref):
    assert isinstance(manager.stats(), ManagerStats)
    manager.start()
    runner = manager.engine.runner
    original = runner._forward
    fail_next = threading.Event()

    def flaky_forward(step):
        if fail_next.is_set():
            fail_next.clear()
            raise RuntimeError("injected")
        return original(step)

    runner._forward = flaky_forward
    ids = manager.add_requests(PROMPTS[:3], max_new_tokens=4)
    collect(manager, ids)
    cancelled = manager.add_request(PROMPTS[3], max_new_tokens=400)
    wait_for(lambda: manager.stats().running == 1, what="the long request to run")
    manager.cancel_request(cancelled)
    collect(manager, [cancelled])
    with manager.pause():
        failed = manager.add_request(PROMPTS[4], max_new_tokens=4)
        fail_next.set()
    assert manager.get_result(failed, timeout=TIMEOUT).status == RequestStatus.FAILED

    stats = manager.stats()
    assert (stats.finished, stats.failed, stats.cancelled) == (3, 1, 1)
    assert (stats.queued, stats.running, stats.pages_in_use) == (0, 0, 0)
    assert stats.pages_total == 64
    assert stats.prefill_tokens >= sum(len(p) for p in PROMPTS[:4])
    assert stats.decode_tokens >= 3 * 3
    assert stats.preemptions == 0
    assert 0.0 <= stats.prefix_cache_hit_rate <= 1.0
    assert stats.tokens_per_second >= 0.0


def test_stats_count_preemptions_and_outputs_stay_exact(model, ref):
    manager = new_manager(model, num_blocks=5)  # 80 tokens of cache for 3 requests of up to 40
    try:
        manager.start()
        prompts = PROMPTS[:3]
        ids = manager.add_requests(prompts, max_new_tokens=30)
        results = collect(manager, ids)
        for rid, prompt in zip(ids, prompts, strict=True):
            assert_finished_like_generate(results[rid], ref, prompt, 30)
        stats = manager.stats()
        assert stats.preemptions > 0
        assert stats.finished == 3 and stats.pages_in_use == 0 and stats.pages_total == 5
        assert_no_leak(manager)
    finally:
        manager.destroy()
