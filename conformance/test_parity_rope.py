"""Greedy parity of dynamic rotary embeddings (issue 48): LongRoPE (Phi-3, whose `generate()` recomputes its
cache at the switch; Llama, whose each call picks its set) and dynamic NTK (Llama, past its native length).

Each request's rows must get what `generate()` gives that request alone (runner/request_rotary.py,
kv/rope_rule.py). The tiny models (`tests.support.models.ROPE_MODELS`) switch at 32 tokens and have
sharpened attention, so a wrong frequency set changes tokens. The prompts straddle the switch (20 to 44
tokens, 12 new tokens each: some cross it while decoding). Runs: the paged backends with and without the
native kernel, x token budgets (5, 16, default); under eviction (recompute); with forks
(`num_return_sequences=2`); with prefix sharing across and within the sets; and with prompt lookup
speculation (Phi-3's drafts stop before its switch). References: a fresh
model's `generate()` per prompt (dynamic NTK's rotary embedding is stateful); tie-aware (`check_parity`).
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from conformance.common import (
    ReferenceCache,
    check_parity,
    check_parity_under_eviction,
    greedy_config,
    reference_greedy,
    run_batch,
)
from tests.support.models import ROPE_MODELS, using_backend
from tests.support.prompts import random_prompts
from transformers_cb import ContinuousBatchingConfig, RequestStatus
from transformers_cb.attention.native.kernel import ENV_SWITCH

MAX_NEW_TOKENS = 12
FAMILIES = tuple(ROPE_MODELS)


class FreshReferences(ReferenceCache):
    """`generate()` of a freshly built model per prompt: the reference of a stateful rotary embedding."""

    def __init__(self, family: str, max_new_tokens: int) -> None:
        super().__init__(ROPE_MODELS[family](), max_new_tokens)
        self.family = family

    def _generate(self, prompt: Sequence[int], max_new_tokens: int, eos_token_id) -> list[int]:
        return reference_greedy(
            ROPE_MODELS[self.family](), prompt, greedy_config(max_new_tokens, eos_token_id)
        )


def straddling_prompts(seed: int = 11) -> list[list[int]]:
    lengths = [20, 26, 31, 32, 33, 38, 44]
    pool = random_prompts(len(lengths), 300, 44, 44, seed=seed)
    return [p[:n] for p, n in zip(pool, lengths, strict=True)]


@pytest.fixture(scope="module", params=FAMILIES)
def rope_family(request):
    family = request.param
    return family, ROPE_MODELS[family](), straddling_prompts(), FreshReferences(family, MAX_NEW_TOKENS)


@pytest.mark.parametrize("native", ["1", "0"], ids=["native", "torch"])
@pytest.mark.parametrize("budget", [5, 16, None], ids=lambda b: f"budget{b}")
@pytest.mark.parametrize("backend", ["paged|sdpa", "paged|eager"])
def test_rope_parity(rope_family, backend: str, budget: int | None, native: str, monkeypatch) -> None:
    family, model, prompts, references = rope_family
    monkeypatch.setenv(ENV_SWITCH, native)
    context = f"{family} / {backend!r} / max_batch_tokens={budget}, native={native}"
    with using_backend(model, "llama", backend):
        outputs, _ = run_batch(
            model, prompts, greedy_config(MAX_NEW_TOKENS), page_size=4, max_batch_tokens=budget
        )
    check_parity(model, prompts, outputs, [references.get(p) for p in prompts], context)


def test_rope_parity_under_eviction(rope_family) -> None:
    family, model, prompts, references = rope_family
    check_parity_under_eviction(model, prompts, references, f"{family} eviction")


def test_rope_forks_equal_generate(rope_family) -> None:
    family, model, prompts, references = rope_family
    outputs = model.generate_batch(
        prompts,
        greedy_config(MAX_NEW_TOKENS),
        continuous_batching_config=ContinuousBatchingConfig(page_size=4, max_batch_tokens=16),
        num_return_sequences=2,
        progress_bar=False,
    )
    parents = {k: v for k, v in outputs.items() if "__child" not in k}
    check_parity(model, prompts, parents, [references.get(p) for p in prompts], f"{family} forks")
    for i in range(len(prompts)):
        child = outputs[f"req_{i}__child#0"]
        assert child.status == RequestStatus.FINISHED, f"{family}: req_{i}__child#0 {child.error}"
        assert child.generated_tokens == outputs[f"req_{i}"].generated_tokens, f"{family}: req_{i}__child#0"


def test_rope_prefix_sharing_across_the_switch(rope_family) -> None:
    """Prompts sharing their first 20 tokens, some below the switch and some past it, queued together and
    again: hits only where the frequency sets agree, every output `generate()`'s."""
    family, model, _, references = rope_family
    base = random_prompts(1, 300, 44, 44, seed=13)[0]
    prompts = [base[:n] for n in (22, 24, 30, 36, 40, 44)] * 2
    outputs, _ = run_batch(model, prompts, greedy_config(MAX_NEW_TOKENS), page_size=4, max_batch_tokens=16)
    check_parity(model, prompts, outputs, [references.get(p) for p in prompts], f"{family} sharing")


def test_rope_prompt_lookup_speculation(rope_family) -> None:
    """Prompt lookup drafts verified in one step across the switch: Phi-3's drafts stop before it (its
    `generate()` recomputes there), every output `generate()`'s."""
    family, model, _, references = rope_family
    pattern = random_prompts(1, 300, 3, 3, seed=18)[0]  # the seed whose outputs repeat it: drafts accepted
    prompts = [(pattern * 12)[:n] for n in (22, 27, 30, 34)]
    outputs = model.generate_batch(
        prompts,
        greedy_config(MAX_NEW_TOKENS),
        continuous_batching_config=ContinuousBatchingConfig(page_size=4, speculation_max_batch_size=10**6),
        prompt_lookup_num_tokens=4,
        progress_bar=False,
    )
    check_parity(model, prompts, outputs, [references.get(p) for p in prompts], f"{family} lookup")
    accepted = sum(output.accepted_draft_tokens for output in outputs.values())
    assert accepted > 0, "no draft token was accepted: the test would pass vacuously"
