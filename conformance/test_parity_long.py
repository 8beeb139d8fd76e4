"""One 4096-token prompt against `generate()` on a tiny sharp model: prefilled in chunks, preempted while
short requests decode beside it, and brought back by recompute or by the host tier (CPU offload).

The model is the suite's tiny Llama with its query / key projections scaled (tests/support/sharp.py), so
that its attention over 4k keys is far from uniform: a wrong position, page or cached key among them
changes tokens. The cache holds the long request and little more, so the short ones take pages it needs
and it is preempted; with offload its pages swap out and back (nothing recomputed), without it they are
computed again. Both equal `generate()` token for token (near-ties aside, as everywhere in the suite).
"""

from __future__ import annotations

import math

import pytest

from conformance.common import check_parity, greedy_config, reference_greedy, run_batch
from tests.support.models import build_tiny_model, vocab_size
from tests.support.prompts import random_prompts
from tests.support.sharp import sharpen

LONG = 4096
MAX_NEW_TOKENS = 6
PAGE_SIZE = 16
BUDGET = 512  # tokens per step: the long prompt is prefilled in 8 chunks
SHORTS = 6  # short requests (24 tokens, 40 new) admitted before it


@pytest.fixture(scope="module")
def subject():
    model = build_tiny_model("llama", seed=0, max_position_embeddings=LONG + 64)
    scaled = sharpen(model)  # not inside an assert: the call must run under python -O too
    assert scaled > 0
    vocab = vocab_size(model)
    long_prompt = random_prompts(1, vocab, LONG, LONG, seed=48)[0]
    shorts = random_prompts(SHORTS, vocab, 24, 24, seed=49)
    prompts = [*shorts, long_prompt]  # the short ones run first; the long one joins them
    new_tokens = [40] * SHORTS + [MAX_NEW_TOKENS]
    references = [
        reference_greedy(model, p, greedy_config(n)) for p, n in zip(prompts, new_tokens, strict=True)
    ]
    return model, prompts, new_tokens, references


@pytest.mark.slow
@pytest.mark.parametrize("offload", [0.0, None], ids=["recompute", "offload"])
def test_a_4k_prompt_chunked_preempted_and_offloaded_equals_generate(subject, offload) -> None:
    model, prompts, new_tokens, references = subject
    # The long request's pages and two more: the short ones' growth takes pages the long one needs.
    num_blocks = math.ceil((LONG + MAX_NEW_TOKENS) / PAGE_SIZE) + 2
    model.set_attn_implementation("paged|sdpa")
    try:
        outputs, preempted = run_batch(
            model,
            prompts,
            greedy_config(max(new_tokens)),
            max_new_tokens=new_tokens,
            page_size=PAGE_SIZE,
            max_batch_tokens=BUDGET,
            num_blocks=num_blocks,
            cpu_offload_space=offload,
            allow_block_sharing=False,
        )
    finally:
        model.set_attn_implementation("sdpa")
    context = (
        f"4k prompt / page_size={PAGE_SIZE}, budget={BUDGET}, num_blocks={num_blocks}, offload={offload}"
    )
    long_id = f"req_{SHORTS}"
    assert long_id in preempted, f"{context}: the long request was never preempted ({preempted})"
    check_parity(model, prompts, outputs, references, context)
