"""Greedy parity on Llama 4 text (chunked attention and NoPE layers): `generate_batch` equals `generate()`.

The tiny model (`tests.support.models.FAMILY_CONFIGS["llama4"]`) has three chunked layers (attention
chunks of 8 tokens, shorter than most prompts) and one full-attention NoPE layer whose queries are scaled
by a temperature of their position that changes every 4 tokens. It runs under the paged backends and
its plain one (switched to paged for the run), with and without the native CPU kernel, x page sizes
{4, 16} x token budgets (5: prefill chunks start inside an attention chunk and cross its boundary;
default), under eviction (a cache just big enough for the largest request) and with prefix sharing. The
chunked group's pages are recycled while running; the engine's integrity check runs after every step.
"""

from __future__ import annotations

import pytest

from conformance.common import ReferenceCache, check_parity, greedy_config, run_batch, tight_num_blocks
from conformance.test_parity_sliding import integrity_checked
from conformance.test_prefix_sharing import check_shared_prefix_parity
from tests.support.models import build_tiny_model, using_backend, vocab_size
from tests.support.prompts import random_prompts
from transformers_cb.attention.native.kernel import ENV_SWITCH

MAX_NEW_TOKENS = 12
FAMILY = "llama4"


@pytest.fixture(scope="module")
def llama4():
    model = build_tiny_model(FAMILY, seed=0)
    prompts = random_prompts(8, vocab_size(model), 1, 40, seed=1)
    return model, prompts, ReferenceCache(model, MAX_NEW_TOKENS)


@pytest.mark.parametrize("native", ["1", "0"], ids=["native", "torch"])
@pytest.mark.parametrize("budget", [5, None], ids=lambda b: f"budget{b}")
@pytest.mark.parametrize("page_size", [4, 16], ids=lambda p: f"page{p}")
@pytest.mark.parametrize("backend", ["paged|sdpa", "paged|eager", "sdpa"])
def test_chunked_parity(
    llama4, backend: str, page_size: int, budget: int | None, native: str, monkeypatch
) -> None:
    model, prompts, references = llama4
    monkeypatch.setenv(ENV_SWITCH, native)
    context = f"llama4 / {backend!r} / page_size={page_size}, max_batch_tokens={budget}, native={native}"
    with using_backend(model, FAMILY, backend), integrity_checked() as steps:
        outputs, _ = run_batch(
            model, prompts, greedy_config(MAX_NEW_TOKENS), page_size=page_size, max_batch_tokens=budget
        )
        assert steps, "the engine never stepped"
        check_parity(model, prompts, outputs, [references.get(p) for p in prompts], context)


@pytest.mark.parametrize("page_size", [4, 16], ids=lambda p: f"page{p}")
@pytest.mark.parametrize("backend", ["paged|sdpa", "paged|eager"])
def test_chunked_parity_under_eviction(llama4, backend: str, page_size: int) -> None:
    model, prompts, references = llama4
    num_blocks = tight_num_blocks(prompts, MAX_NEW_TOKENS, page_size)
    context = f"llama4 / {backend!r} / page_size={page_size}, max_batch_tokens=16, num_blocks={num_blocks}"
    with using_backend(model, FAMILY, backend), integrity_checked():
        outputs, preemptions = run_batch(
            model,
            prompts,
            greedy_config(MAX_NEW_TOKENS),
            page_size=page_size,
            max_batch_tokens=16,
            num_blocks=num_blocks,
        )
        assert preemptions, f"{context}: no request was evicted; the test does not exercise eviction"
        check_parity(model, prompts, outputs, [references.get(p) for p in prompts], context)


def test_chunked_model_shares_prefixes_and_matches_generate(llama4) -> None:
    """Hits on the chunked group take only the pages from the current attention chunk on (the shared 12
    tokens span two chunks of 8); the full NoPE group takes every page."""
    model, _, references = llama4
    check_shared_prefix_parity(model, references, "llama4 sharing", MAX_NEW_TOKENS)
