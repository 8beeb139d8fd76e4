"""Adapters per request (issue 50, docs/adapters.md): requests on three LoRA adapters of different ranks
(one rsLoRA, one adapting the head) and on the base model, interleaved in one batch, each equal to
`generate()` after `set_adapter(x)` (or with the adapters disabled), greedy fp32, on every backend, chunked
(a small token budget) and under a cache so small that requests are preempted and recomputed; with every
eligible Linear packed. Attention is sharpened (tests/support/models.py) so that a wrong key moves the
argmax, and each adapter is shown to change the tokens.
"""

from __future__ import annotations

import pytest

from conformance.common import check_parity, greedy_config, run_batch, tight_num_blocks
from conformance.test_parity_offload import engines_checked
from tests.support.adapters import adapted_llama, reference_on
from tests.support.models import BACKENDS, tiny_llama, using_backend
from tests.support.preemptions import count_preemptions
from transformers_cb import ContinuousBatchingConfig
from transformers_cb.runner.products.packed_linear import RULE_ENV

pytest.importorskip("peft", reason="the adapter tests need peft (the test extra installs it)")

MAX_NEW_TOKENS = 8
PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11],
    [20, 21, 22],
    [30, 31, 32, 33, 34, 35, 36, 37, 38],
    [40, 41],
    [50, 51, 52, 53, 54],
    [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70],
    [30, 31, 32, 33, 34, 35, 36, 37, 38],
    [71, 72, 73, 74],
]
ADAPTERS = ["a", "b", "c", None, "b", None, "c", "a"]


@pytest.fixture(scope="module")
def adapted():
    model = adapted_llama()
    model.set_adapter("a")
    references = [reference_on(model, p, a, MAX_NEW_TOKENS) for p, a in zip(PROMPTS, ADAPTERS, strict=True)]
    return model, references


def test_each_adapter_changes_the_tokens(adapted) -> None:
    model, _ = adapted
    outcomes = {name: reference_on(model, PROMPTS[2], name, MAX_NEW_TOKENS) for name in ["a", "b", "c", None]}
    assert len({tuple(tokens) for tokens in outcomes.values()}) == 4, f"the test could not fail: {outcomes}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_adapters_in_one_batch_equal_generate_chunked_and_preempted(
    adapted, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(RULE_ENV, "all")  # every eligible Linear packed, base layers included
    model, references = adapted
    num_blocks = tight_num_blocks(PROMPTS, MAX_NEW_TOKENS, 4)
    with using_backend(model, "llama", backend), count_preemptions() as preempted:
        outputs = model.generate_batch(
            PROMPTS,
            generation_config=greedy_config(MAX_NEW_TOKENS),
            continuous_batching_config=ContinuousBatchingConfig(
                page_size=4, max_batch_tokens=6, num_blocks=num_blocks
            ),
            adapter=ADAPTERS,
            progress_bar=False,
        )
    assert preempted, "no request was preempted: the run does not exercise recompute"
    check_parity(model, PROMPTS, outputs, references, f"mixed adapters, {backend}")


def test_mixed_adapters_swapped_to_the_host_tier_and_back(adapted) -> None:
    """Preempted requests swap out to the host tier and back: each stays on its adapter."""
    model, references = adapted
    with engines_checked() as engines:
        outputs = model.generate_batch(
            PROMPTS,
            generation_config=greedy_config(MAX_NEW_TOKENS),
            continuous_batching_config=ContinuousBatchingConfig(
                page_size=4,
                max_batch_tokens=6,
                num_blocks=tight_num_blocks(PROMPTS, MAX_NEW_TOKENS, 4),
                cpu_offload_space=None,
            ),
            adapter=ADAPTERS,
            progress_bar=False,
        )
    (engine,) = engines
    assert engine.offload is not None and engine.offload.swap_out_pages > 0, "nothing was swapped out"
    check_parity(model, PROMPTS, outputs, references, "mixed adapters, CPU offload")


def test_mixed_adapters_speculating_by_prompt_lookup(adapted) -> None:
    model, references = adapted
    outputs = model.generate_batch(
        PROMPTS,
        generation_config=greedy_config(MAX_NEW_TOKENS),
        continuous_batching_config=ContinuousBatchingConfig(page_size=4),
        adapter=ADAPTERS,
        prompt_lookup_num_tokens=3,
        progress_bar=False,
    )
    assert sum(output.draft_tokens for output in outputs.values()) > 0, "nothing was speculated"
    check_parity(model, PROMPTS, outputs, references, "mixed adapters, prompt lookup")


def test_forks_keep_their_parents_adapter(adapted) -> None:
    model, references = adapted
    outputs = model.generate_batch(
        PROMPTS[:4],
        generation_config=greedy_config(MAX_NEW_TOKENS),
        continuous_batching_config=ContinuousBatchingConfig(page_size=4),
        adapter=ADAPTERS[:4],
        num_return_sequences=2,
        progress_bar=False,
    )
    for i in range(4):
        for request_id in (f"req_{i}", f"req_{i}__child#0"):
            assert outputs[request_id].generated_tokens == references[i], (request_id, ADAPTERS[i])


def test_no_adapter_given_runs_the_active_adapter(adapted) -> None:
    """Today's behaviour (issue 47): without `adapter=`, the model's active adapter, as `generate()`."""
    model, references = adapted
    model.set_adapter("b")
    try:
        outputs, _ = run_batch(model, [PROMPTS[4]], greedy_config(MAX_NEW_TOKENS), page_size=4)
    finally:
        model.set_adapter("a")
    check_parity(model, [PROMPTS[4]], outputs, [references[4]], "no adapter= on the active adapter b")


def test_a_draft_model_speculates_for_requests_on_adapters(adapted) -> None:
    """The draft model (no adapter) only proposes; the target verifies each request's drafts on its own
    adapter's rows, so the tokens are the adapter's."""
    model, references = adapted
    outputs = model.generate_batch(
        PROMPTS,
        generation_config=greedy_config(MAX_NEW_TOKENS),
        continuous_batching_config=ContinuousBatchingConfig(page_size=4),
        adapter=ADAPTERS,
        assistant_model=tiny_llama(seed=1),
        progress_bar=False,
    )
    assert sum(output.draft_tokens for output in outputs.values()) > 0, "nothing was speculated"
    check_parity(model, PROMPTS, outputs, references, "mixed adapters, draft model")
