"""The manager with prefix sharing and forks: per-request `num_return_sequences`, result keys, cancel,
`add_requests`' sorted admission, and the prefix-cache fields of `stats()`."""

from __future__ import annotations

import pytest

from tests.support.manager import References, collect, make_model, new_manager
from tests.support.prompts import prompts_of_lengths
from tests.support.threads import TIMEOUT
from transformers_cb import RequestStatus

SHARED = prompts_of_lengths([32], seed=3)[0]
PROMPTS = [SHARED + tail for tail in prompts_of_lengths([3, 9, 5, 7], seed=4)]


@pytest.fixture(scope="module")
def model():
    return make_model()


@pytest.fixture(scope="module")
def ref():
    return References(make_model())


def test_num_return_sequences_per_request_gives_one_result_per_sibling(model, ref) -> None:
    manager = new_manager(model, page_size=4)
    manager.start()
    try:
        parent = manager.add_request(PROMPTS[0], request_id="q", max_new_tokens=6, num_return_sequences=3)
        assert parent == "q"
        results = collect(manager, ["q", "q__child#0", "q__child#1"])
        assert {o.status for o in results.values()} == {RequestStatus.FINISHED}
        assert all(o.generated_tokens == ref(PROMPTS[0], 6) for o in results.values())
        other = manager.add_request(PROMPTS[1], max_new_tokens=3)  # default: one sequence
        assert set(collect(manager, [other])) == {other}
    finally:
        manager.stop(block=True, timeout=TIMEOUT)


def test_bad_num_return_sequences_is_refused_at_submission(model) -> None:
    manager = new_manager(model)
    try:
        with pytest.raises(ValueError, match="num_return_sequences must be an int >= 1"):
            manager.add_request(PROMPTS[0], num_return_sequences=0)
        manager.add_request(PROMPTS[0], request_id="x__child#0", max_new_tokens=2)
        with pytest.raises(ValueError, match="a fork of 'x'"):
            manager.add_request(PROMPTS[1], request_id="x", num_return_sequences=2)
    finally:
        manager.stop(block=True, timeout=TIMEOUT)


def test_cancelling_a_sibling_before_its_fork(model, ref) -> None:
    manager = new_manager(model, page_size=4)
    try:
        manager.add_request(PROMPTS[2], request_id="p", max_new_tokens=5, num_return_sequences=3)
        manager.cancel_request("p__child#1")  # not started: applied at once, before any fork
        manager.start()
        results = collect(manager, ["p", "p__child#0", "p__child#1"])
        assert results["p__child#1"].status == RequestStatus.CANCELLED
        assert results["p__child#0"].generated_tokens == results["p"].generated_tokens == ref(PROMPTS[2], 5)
    finally:
        manager.stop(block=True, timeout=TIMEOUT)


def test_add_requests_sorts_for_sharing_but_ids_keep_their_prompts(model, ref) -> None:
    manager = new_manager(model, page_size=4)
    try:
        inputs = [PROMPTS[3], [5, 6, 7], PROMPTS[1], PROMPTS[0]]
        ids = manager.add_requests(inputs, max_new_tokens=4)
        queued = [request.prompt_ids for request in manager._state.incoming]
        assert queued == sorted(inputs)  # admission order: by prompt
        manager.start()
        results = collect(manager, ids)
        for request_id, prompt in zip(ids, inputs, strict=True):
            assert results[request_id].prompt_ids == prompt
            assert results[request_id].generated_tokens == ref(prompt, 4)
        stats = manager.stats()
        assert 0.0 < stats.prefix_cache_hit_rate < 1.0
        assert stats.prefix_cache_hit_tokens == 2 * 32  # 3 prompts share 32 tokens (8 pages): 2 hit them
        assert stats.prefix_cache_pages > 0 and stats.pages_in_use == 0
        assert stats.prefix_cache_evictions == 0
    finally:
        manager.stop(block=True, timeout=TIMEOUT)


def test_sharing_off_keeps_submission_order_and_reports_no_hits(model) -> None:
    manager = new_manager(model, page_size=4, allow_block_sharing=False)
    try:
        inputs = [PROMPTS[3], PROMPTS[0]]
        ids = manager.add_requests(inputs, max_new_tokens=2)
        assert [request.prompt_ids for request in manager._state.incoming] == inputs
        manager.start()
        collect(manager, ids)
        stats = manager.stats()
        assert stats.prefix_cache_hit_rate == 0.0 and stats.prefix_cache_pages == 0
    finally:
        manager.stop(block=True, timeout=TIMEOUT)


def test_an_idle_manager_hits_no_prefix_page_computed_with_older_weights() -> None:
    """A weight update while the manager idles (TRL's weight sync between rollouts) must not be hidden
    by prefix pages computed with the old weights."""
    import torch
    from transformers import GenerationConfig

    from tests.support.models import tiny_llama_without_eos
    from tests.support.prompts import prompts_of_lengths
    from tests.support.reference import greedy_reference
    from tests.support.timeouts import hang_guard
    from transformers_cb import ContinuousBatchingConfig

    model = tiny_llama_without_eos()
    prompt = prompts_of_lengths([40], seed=5)[0]
    manager = model.init_continuous_batching(
        generation_config=GenerationConfig(max_new_tokens=6, do_sample=False),
        continuous_batching_config=ContinuousBatchingConfig(page_size=8, num_blocks=64),
    )
    manager.start()
    try:
        first = manager.get_result(manager.add_request(prompt), timeout=hang_guard(120))
        with manager.pause(), torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.k_proj.weight.mul_(-1.5)
        second = manager.get_result(manager.add_request(prompt), timeout=hang_guard(120))
        assert second.generated_tokens == greedy_reference(model, prompt, 6) != first.generated_tokens
    finally:
        manager.stop(block=True)
