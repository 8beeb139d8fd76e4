"""Adapters loaded, updated in place and unloaded while a manager runs (`manager.adapters`,
manager/adapters.py, docs/adapters.md): a loaded adapter serves requests at once; an update is a new
version of that adapter (its later requests hit none of the pages computed before it, and equal
`generate()` on the new weights); an adapter a live request uses is not unloaded, an unloaded one is
unknown to later submissions."""

from __future__ import annotations

import pytest
import torch

from tests.support.adapters import adapted_llama, logprobs_on, reference_on
from transformers_cb import ContinuousBatchingConfig
from transformers_cb.conformance_check import greedy_config

peft = pytest.importorskip("peft", reason="the adapter tests need peft (the test extra installs it)")

MAX_NEW_TOKENS = 6
PROMPT = list(range(10, 27))  # four full 4-token pages


@pytest.fixture
def running():
    model = adapted_llama(("a", "b"))
    manager = model.init_continuous_batching(
        generation_config=greedy_config(MAX_NEW_TOKENS),
        continuous_batching_config=ContinuousBatchingConfig(page_size=4, num_blocks=64),
    )
    manager.start()
    try:
        yield model, manager
    finally:
        manager.stop(hard_stop=True)


def _run(manager, adapter: str | None) -> tuple[list[int], int]:
    """The request's tokens, and the prefix hit tokens it had."""
    before = manager.stats().prefix_cache_hit_tokens
    request_id = manager.add_request(PROMPT, adapter=adapter, max_new_tokens=MAX_NEW_TOKENS)
    output = manager.get_result(request_id=request_id, timeout=120)
    return output.generated_tokens, manager.stats().prefix_cache_hit_tokens - before


def test_an_adapter_loaded_while_running_serves_at_once() -> None:
    """Into a model that had no adapter when the run session started: the LoRA rows are split from the
    first step with requests on adapters, and the native MLP forward installed at the start calls the LoRA
    layers that now stand in for its projections (it called the plain Linears it saw then: the delta was
    lost, tests/serve/test_adapters.py's logprobs showed it)."""
    model = adapted_llama(())
    manager = model.init_continuous_batching(
        generation_config=greedy_config(MAX_NEW_TOKENS),
        continuous_batching_config=ContinuousBatchingConfig(page_size=4, num_blocks=64),
    )
    manager.start()
    try:
        _run(manager, None)  # a step before any adapter exists
        config = peft.LoraConfig(
            r=6, lora_alpha=12, init_lora_weights=False, target_modules=["gate_proj", "up_proj", "down_proj"]
        )
        manager.adapters.load("d", config)
        assert manager.adapters.names() == ["d"]
        with pytest.raises(ValueError, match="already loaded"):
            manager.adapters.load("d", config)
        generator = torch.Generator().manual_seed(5)  # weights that move the tokens through the MLP alone
        saved = model.get_adapter_state_dict("d")
        manager.adapters.update("d", {k: torch.randn(v.shape, generator=generator) for k, v in saved.items()})
        with manager.pause():  # both in one step: the rows on d and the base model's
            ids = manager.add_requests(
                [PROMPT, PROMPT[:9]], adapter=["d", None], max_new_tokens=MAX_NEW_TOKENS, top_logprobs=1
            )
        for request_id, prompt, adapter in zip(ids, [PROMPT, PROMPT[:9]], ["d", None], strict=True):
            output = manager.get_result(request_id=request_id, timeout=120)
            tokens = output.generated_tokens
            assert tokens == reference_on(model, prompt, adapter, MAX_NEW_TOKENS), adapter
            assert output.logprobs == pytest.approx(logprobs_on(model, prompt, tokens, adapter), abs=1e-4), (
                adapter
            )
        assert reference_on(model, PROMPT, "d", MAX_NEW_TOKENS) != reference_on(
            model, PROMPT, None, MAX_NEW_TOKENS
        )
    finally:
        manager.stop(hard_stop=True)


def test_an_update_in_place_is_a_new_version_of_the_adapter(running) -> None:
    model, manager = running
    first, _ = _run(manager, "a")
    again, hits = _run(manager, "a")
    assert again == first and hits == 16, "no prefix hit within one version of adapter a"
    generator = torch.Generator().manual_seed(7)
    saved = model.get_adapter_state_dict("a")  # PEFT's keys (no adapter name in them)
    new = {key: torch.randn(value.shape, generator=generator) * 0.3 for key, value in saved.items()}
    assert manager.adapters.update("a", new) == 1
    with pytest.raises(ValueError, match="none of its parameters"):
        manager.adapters.update("a", {"model.layers.0.nope.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="has shape"):
        manager.adapters.update("a", {next(iter(saved)): torch.zeros(1)})
    updated, hits = _run(manager, "a")
    assert hits == 0, "a page computed under the adapter's old version was hit"
    assert updated == reference_on(model, PROMPT, "a", MAX_NEW_TOKENS)
    assert updated != first, "the update changed no token: the test could not fail"


def test_an_adapter_in_use_is_not_unloaded(running) -> None:
    model, manager = running
    with manager.pause():  # the request stays live while unload is tried
        request_id = manager.add_request(PROMPT, adapter="b", max_new_tokens=MAX_NEW_TOKENS)
        assert manager.adapters.in_use() == {"b": 1}
        with pytest.raises(ValueError, match="in use by 1 live request"):
            manager.adapters.unload("b")
    output = manager.get_result(request_id=request_id, timeout=120)
    assert output.generated_tokens == reference_on(model, PROMPT, "b", MAX_NEW_TOKENS)
    manager.adapters.unload("b")
    assert manager.adapters.names() == ["a"]
    with pytest.raises(ValueError, match=r"unknown adapter 'b'; the model's adapters: \['a'\]"):
        manager.add_request(PROMPT, adapter="b")
    tokens, _ = _run(manager, "a")
    assert tokens == reference_on(model, PROMPT, "a", MAX_NEW_TOKENS)


def test_an_adapter_merged_while_requests_chose_theirs_fails_them_with_the_reason(running) -> None:
    """A merge puts adapter a in every row's base weights: the requests in flight that chose an adapter fail
    (they would run with a on top of theirs), later ones are refused at submission; none runs silently."""
    from transformers_cb import RequestStatus
    from transformers_cb.runner.adapter_rows import lora_linear_class

    model, manager = running
    with manager.pause():
        request_id = manager.add_request(PROMPT, adapter="b", max_new_tokens=MAX_NEW_TOKENS)
        for module in model.modules():
            if type(module) is lora_linear_class():
                module.merge(adapter_names=["a"])
    output = manager.get_result(request_id=request_id, timeout=120)
    assert output.status == RequestStatus.FAILED
    assert "can no longer be applied per request" in output.error and "merged" in output.error
    with pytest.raises(ValueError, match="merged into the base weights"):
        manager.add_request(PROMPT, adapter="b")
    assert manager.is_running()
