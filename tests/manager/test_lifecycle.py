"""ContinuousBatchingManager lifecycle: a new manager is not started, the context manager starts, stops
(gracefully, or hard when the block raises) and destroys, and the persistent manager is cached and reused."""

from __future__ import annotations

import pytest

from tests.support.manager import (
    CB_CONFIG,
    PROMPTS,
    assert_finished_like_generate,
    collect,
)
from tests.support.threads import TIMEOUT
from transformers_cb import (
    ContinuousBatchingConfig,
    ContinuousBatchingManager,
    RequestStatus,
)
from transformers_cb.api.model_methods import CACHED_MANAGER_ATTR


def test_init_returns_a_manager_that_is_not_started(manager):
    assert isinstance(manager, ContinuousBatchingManager)
    assert not manager.is_running()
    manager.start()
    assert manager.is_running()
    manager.start()  # a second start is a harmless no-op
    assert manager.is_running()
    manager.stop()
    assert not manager.is_running()


def test_context_manager_starts_stops_and_destroys(model, ref):
    config = ContinuousBatchingConfig(**CB_CONFIG)
    with model.continuous_batching_context_manager(continuous_batching_config=config) as manager:
        assert manager.is_running()
        rid = manager.add_request(PROMPTS[0], max_new_tokens=5)
        assert_finished_like_generate(manager.get_result(timeout=TIMEOUT), ref, PROMPTS[0], 5)
        assert rid is not None
    assert not manager.is_running()
    assert manager.engine is None
    assert getattr(model, CACHED_MANAGER_ATTR, None) is None
    with pytest.raises(RuntimeError, match="destroyed"):
        manager.start()
    assert model.config._attn_implementation == "sdpa", "the user's attention backend is restored"


def test_context_manager_stops_gracefully_on_normal_exit(model, ref):
    config = ContinuousBatchingConfig(**CB_CONFIG)
    with model.continuous_batching_context_manager(continuous_batching_config=config) as manager:
        ids = [manager.add_request(p, max_new_tokens=4) for p in PROMPTS[:3]]
    # The queued requests completed before the context returned; their results are still readable.
    results = collect(manager, ids)
    for rid, prompt in zip(ids, PROMPTS[:3], strict=True):
        assert_finished_like_generate(results[rid], ref, prompt, 4)


def test_context_manager_hard_stops_when_the_block_raises(model):
    config = ContinuousBatchingConfig(**CB_CONFIG)
    with (
        pytest.raises(ZeroDivisionError),
        model.continuous_batching_context_manager(continuous_batching_config=config) as manager,
    ):
        rid = manager.add_request(PROMPTS[0], max_new_tokens=400)
        1 / 0  # noqa: B018
    output = manager.get_result(timeout=TIMEOUT)
    assert output.request_id == rid
    assert output.status == RequestStatus.FAILED
    assert "RuntimeError" in output.error
    assert manager.engine is None


def test_persistent_manager_is_cached_and_reused(model, ref):
    config = ContinuousBatchingConfig(**CB_CONFIG)
    with model.continuous_batching_context_manager(
        continuous_batching_config=config, persistent_manager=True
    ) as first:
        manager_id = first.add_request(PROMPTS[0], max_new_tokens=3)
        assert_finished_like_generate(first.get_result(timeout=TIMEOUT), ref, PROMPTS[0], 3)
    assert not first.is_running()
    assert first.engine is not None, "a persistent manager is stopped, not destroyed"
    assert getattr(model, CACHED_MANAGER_ATTR) is first

    with model.continuous_batching_context_manager(persistent_manager=True) as second:
        assert second is first
        assert second.is_running()
        rid = second.add_request(PROMPTS[1], max_new_tokens=3)
        assert rid != manager_id
        assert_finished_like_generate(second.get_result(timeout=TIMEOUT), ref, PROMPTS[1], 3)
    assert not first.is_running()

    model.destroy_cached_continuous_batching_manager()
    assert getattr(model, CACHED_MANAGER_ATTR, None) is None
    assert first.engine is None
    with pytest.raises(RuntimeError, match="destroyed"):
        first.start()
    model.destroy_cached_continuous_batching_manager()  # nothing cached: a no-op
