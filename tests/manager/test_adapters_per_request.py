"""Adapters per request through the manager (issue 50, docs/adapters.md): `add_request(adapter=...)` on a
model carrying three LoRA adapters; an unknown adapter is a `ValueError` at submission naming it and the
known ones, and the requests beside it finish on their own adapters; the prefix cache shares pages within
one adapter and never across two (the engine's hit counters)."""

from __future__ import annotations

import pytest

from tests.support.adapters import adapted_llama, reference_on
from transformers_cb import ContinuousBatchingConfig, RequestStatus
from transformers_cb.conformance_check import greedy_config

pytest.importorskip("peft", reason="the adapter tests need peft (the test extra installs it)")

MAX_NEW_TOKENS = 6
PROMPT = list(range(10, 27))  # 17 tokens: four full 4-token pages to share


@pytest.fixture(scope="module")
def model():
    return adapted_llama()


def _manager(model):
    manager = model.init_continuous_batching(
        generation_config=greedy_config(MAX_NEW_TOKENS),
        continuous_batching_config=ContinuousBatchingConfig(page_size=4, num_blocks=64),
    )
    manager.start()
    return manager


def test_an_unknown_adapter_is_refused_at_submission_and_the_others_finish(model) -> None:
    manager = _manager(model)
    try:
        first = manager.add_request(PROMPT, adapter="a", max_new_tokens=MAX_NEW_TOKENS)
        with pytest.raises(ValueError, match=r"unknown adapter 'nope'.*\['a', 'b', 'c'\]"):
            manager.add_request(PROMPT, adapter="nope", max_new_tokens=MAX_NEW_TOKENS)
        with pytest.raises(ValueError, match="inputs\\[1\\].*unknown adapter 'z'"):
            manager.add_requests([PROMPT, PROMPT], adapter=["b", "z"], max_new_tokens=MAX_NEW_TOKENS)
        second = manager.add_request(PROMPT, adapter=None, max_new_tokens=MAX_NEW_TOKENS)
        third, fourth = manager.add_requests(
            [PROMPT, PROMPT[:9]], adapter=["c", "b"], max_new_tokens=MAX_NEW_TOKENS
        )
        expected = {
            first: ("a", PROMPT),
            second: (None, PROMPT),
            third: ("c", PROMPT),
            fourth: ("b", PROMPT[:9]),
        }
        for request_id, (adapter, prompt) in expected.items():
            output = manager.get_result(request_id=request_id, timeout=120)
            assert output is not None and output.status == RequestStatus.FINISHED
            assert output.generated_tokens == reference_on(model, prompt, adapter, MAX_NEW_TOKENS), adapter
        assert manager.is_running()
    finally:
        manager.stop(hard_stop=True)


def test_prefix_pages_are_shared_within_an_adapter_and_never_across(model) -> None:
    manager = _manager(model)
    try:

        def run(adapter: str | None) -> int:
            before = manager.stats().prefix_cache_hit_tokens
            request_id = manager.add_request(PROMPT, adapter=adapter, max_new_tokens=MAX_NEW_TOKENS)
            output = manager.get_result(request_id=request_id, timeout=120)
            assert output.generated_tokens == reference_on(model, PROMPT, adapter, MAX_NEW_TOKENS), adapter
            return manager.stats().prefix_cache_hit_tokens - before

        assert run("a") == 0
        assert run("b") == 0, "a hit across adapters a and b"
        assert run(None) == 0, "a hit across adapter b and the base model"
        assert run("a") == 16, "no hit within adapter a"
        assert run(None) == 16, "no hit within the base model"
    finally:
        manager.stop(hard_stop=True)
