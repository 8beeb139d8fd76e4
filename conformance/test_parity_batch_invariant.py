"""Batch-invariant mode (`ContinuousBatchingConfig(batch_invariant=True)`) against `generate()` and itself.

Its fixed-shape products and all-native attention round differently from `generate()`'s, so greedy parity
is tie-aware as everywhere; and its own promise is checked across settings: every request's tokens and
logprobs are the same bits under every token budget, page size and cache size (eviction included), the
batch of 8 requests against each request run alone. Families: Llama, Qwen2 (q/k/v biases), Qwen3 (head
size other than hidden / heads, q/k norms), Mistral and Gemma 3 (sliding windows of 8 tokens), float32
and bfloat16.
"""

from __future__ import annotations

import pytest
import torch

from conformance.common import ReferenceCache, check_parity, greedy_config, run_batch, tight_num_blocks
from tests.support.models import build_tiny_model, vocab_size
from tests.support.prompts import random_prompts
from transformers_cb.attention.native.kernel import ensure_native_module

MAX_NEW_TOKENS = 10
FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gemma3"]
# (page size, max_batch_tokens, num_blocks: None or "tight")
SETTINGS = [(16, None, None), (4, 5, None), (16, 16, "tight"), (4, 24, None)]


@pytest.fixture(autouse=True)
def _native_kernel() -> None:
    if ensure_native_module() is None:
        pytest.skip("the native CPU kernel cannot be built here (see the logged reason)")


def invariant_run(model, prompts, page_size: int, budget: int | None, num_blocks: int | None):
    outputs, _ = run_batch(
        model,
        prompts,
        greedy_config(MAX_NEW_TOKENS),
        page_size=page_size,
        max_batch_tokens=budget,
        num_blocks=num_blocks,
        batch_invariant=True,
        return_logprobs=True,
    )
    return outputs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("family", FAMILIES)
def test_batch_invariant_outputs_are_generates_and_the_same_under_every_setting(family: str, dtype) -> None:
    model = build_tiny_model(family, seed=0).to(dtype)
    prompts = random_prompts(8, vocab_size(model), 1, 40, seed=2)
    references = ReferenceCache(model, MAX_NEW_TOKENS)
    runs = {}
    for page_size, budget, blocks in SETTINGS:
        num_blocks = tight_num_blocks(prompts, MAX_NEW_TOKENS, page_size) if blocks else None
        outputs = invariant_run(model, prompts, page_size, budget, num_blocks)
        context = (
            f"{family} {dtype} batch_invariant page_size={page_size} budget={budget} blocks={num_blocks}"
        )
        check_parity(model, prompts, outputs, [references.get(p) for p in prompts], context)
        runs[context] = {rid: (o.generated_tokens, o.logprobs) for rid, o in outputs.items()}
    first = next(iter(runs.values()))
    for context, run in runs.items():
        assert run == first, f"{context}: tokens or logprobs differ from {next(iter(runs))}"
    for i, prompt in enumerate(prompts):
        alone = invariant_run(model, [prompt], 16, None, None)["req_0"]
        assert (alone.generated_tokens, alone.logprobs) == first[f"req_{i}"], (
            f"{family} {dtype} req_{i} alone"
        )
