"""Long prompts on the native kernel's query tiles (issue 46): where the vector kernel takes the model's head
shape, every prefill chunk (on AVX2: up to a measured length, past these prompts') joins the native call (`BatchPacker.every_long_chunk_native`), its
tokens attended in tiles that share each widened K/V block. Outputs equal `generate()`'s: float32 exactly,
bfloat16 tie-aware, with attention sharpened so that a wrong key, position or probability changes tokens."""

from __future__ import annotations

import sys

import pytest
import torch
from transformers import GenerationConfig

from conformance.common import check_parity, reference_greedy, run_batch
from tests.support.models import TINY_SHAPE, build_model, sharpen_attention, tiny_llama
from tests.support.prompts import prompts_of_lengths
from transformers_cb import ContinuousBatchingConfig
from transformers_cb.attention.native.kernel import (
    cpu_has_amx,
    ensure_native_module,
    vector_kernels,
    vector_lanes,
)
from transformers_cb.engine.build import build_engine

MAX_NEW_TOKENS = 12
LENGTHS = [420, 7, 150, 1, 300, 33, 129]


def _model(family: str, dtype: torch.dtype):
    # head size 64 (the vector kernel's), 4 query heads on 2 KV heads; Mistral's layers slide a 48-token window
    # (its chunks take the per-token kernel: a window's first key moves with each token)
    if family == "mistral":
        model = build_model("mistral", 11, "sdpa", **{**TINY_SHAPE, "head_dim": 64, "sliding_window": 48})
    else:
        model = tiny_llama(seed=11, head_dim=64)
    return sharpen_attention(model).to(dtype)


def _greedy() -> GenerationConfig:
    return GenerationConfig(max_new_tokens=MAX_NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)


@pytest.mark.parametrize("family", ["llama", "mistral"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("max_batch_tokens", [96, 1024], ids=["chunked", "whole"])
def test_long_prompts_in_query_tiles_equal_generate(
    family: str, dtype: torch.dtype, max_batch_tokens: int
) -> None:
    if ensure_native_module() is None or not vector_kernels():
        pytest.skip("the vector kernels are not built here")
    if dtype == torch.bfloat16 and cpu_has_amx():
        pytest.skip("on an AMX CPU bf16 chunks over the short-chunk bound keep SDPA")
    model = _model(family, dtype)
    config = ContinuousBatchingConfig(page_size=16, max_batch_tokens=max_batch_tokens)
    engine = build_engine(model, _greedy(), config)
    longest = max(LENGTHS)  # no chunk of these prompts is too long for it (AVX-512: none at all)
    assert engine.runner.packer.native_prefill_max_work >= longest * (longest + MAX_NEW_TOKENS)
    if vector_lanes() == 16:
        assert engine.runner.packer.native_prefill_max_work == sys.maxsize
    prompts = prompts_of_lengths(LENGTHS, seed=5)
    references = [reference_greedy(model, p, _greedy()) for p in prompts]
    assert len({tuple(r) for r in references}) > 1  # the sharpened model's outputs depend on the prompt
    outputs, _ = run_batch(model, prompts, _greedy(), page_size=16, max_batch_tokens=max_batch_tokens)
    if dtype == torch.float32:
        got = [outputs[f"req_{i}"].generated_tokens for i in range(len(prompts))]
        assert got == references
    check_parity(model, prompts, outputs, references, f"query tiles {family} {dtype} {max_batch_tokens}")
