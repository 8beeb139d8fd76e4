"""Greedy parity of DeepSeek sparse attention (attention/families/sparse_index.py): DeepSeek V3.2 and HY-V4 (attention
sinks, layers reusing the previous layer's selection) with an indexer that selects 6 keys per query, fewer
than most prompts hold, so the selection changes what each query attends (checked: `generate()` itself gives
other tokens when every key is selected).

The pages hold each token's latent row and the indexer's key after it; each step's indexer runs once per
request over that request's paged indexer keys. Each model runs with chunked prefill (5 and 16-token steps)
under preemption (a cache just big enough for the largest request), with CPU offload (the rows swap out and
back with their indexer keys), with prefix hits and on the native CPU kernel's steps as on the torch path,
the engine's integrity check after every step.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from conformance.common import ReferenceCache, check_parity, greedy_config, run_batch, tight_num_blocks
from conformance.test_parity_latent import check_logprobs, kernel  # noqa: F401  (the fixture)
from conformance.test_parity_offload import engines_checked
from conformance.test_prefix_sharing import check_shared_prefix_parity
from tests.support.prompts import random_prompts
from transformers_cb import ContinuousBatchingConfig
from transformers_cb.engine.build import build_engine

MAX_NEW_TOKENS = 10
VOCAB = 300
RANK, ROPE, INDEX_DIM, TOPK = 16, 4, 8, 6
SHAPE = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 16,
    "kv_lora_rank": RANK,
    "qk_rope_head_dim": ROPE,
    "qk_nope_head_dim": 8,
    "v_head_dim": 6,
    "index_head_dim": INDEX_DIM,
    "index_n_heads": 8,
    "index_topk": TOPK,
    "intermediate_size": 48,
    "moe_intermediate_size": 16,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "initializer_range": 0.1,
}


def _tiny(model_type: str, plain: str = "sdpa", **overrides) -> PreTrainedModel:
    config = AutoConfig.for_model(model_type, **{**SHAPE, **overrides})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.set_attn_implementation(plain)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


MODELS: dict[str, Callable[[], PreTrainedModel]] = {
    "deepseek_v32": lambda: _tiny("deepseek_v32"),
    "hy_v4": lambda: _tiny("hy_v4", plain="eager", pad_token_id=0),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def subject(request):
    model = MODELS[request.param]()
    prompts = random_prompts(6, VOCAB, 8, 30, seed=1)
    return request.param, model, prompts, ReferenceCache(model, MAX_NEW_TOKENS)


def test_the_selection_changes_generates_tokens(subject) -> None:
    """With every key selected, generate() continues otherwise: the tests below exercise the selection."""
    name, model, prompts, references = subject
    dense = copy.deepcopy(model)
    for module in dense.modules():
        if isinstance(getattr(module, "index_topk", None), int):
            module.index_topk = 10_000
    dense_references = ReferenceCache(dense, MAX_NEW_TOKENS)
    differ = [p for p in prompts if dense_references.get(p) != references.get(p)]
    assert differ, f"{name}: selecting {TOPK} keys changes no prompt's tokens"


def test_the_pages_hold_the_indexer_keys_after_the_latent(subject) -> None:
    _, model, _, _ = subject
    engine = build_engine(model, greedy_config(MAX_NEW_TOKENS), ContinuousBatchingConfig(page_size=4))
    layout = engine.settings.cache.layout
    (group,) = layout.groups
    assert group.latent == (RANK, ROPE) and group.index_dim == INDEX_DIM
    assert layout.row_shape(0) == (1, RANK + ROPE + INDEX_DIM)
    assert engine.snapshot().kv_bytes_per_token == 2 * (RANK + ROPE + INDEX_DIM) * 4
    assert engine.settings.shape.kv_bytes_per_token(4) == 2 * (RANK + ROPE + INDEX_DIM) * 4


@pytest.mark.parametrize("budget", [5, 16], ids=lambda b: f"budget{b}")
def test_sparse_parity_chunked_and_preempted(subject, kernel: str, budget: int) -> None:  # noqa: F811
    name, model, prompts, references = subject
    num_blocks = tight_num_blocks(prompts, MAX_NEW_TOKENS, 4)
    context = f"{name} / native={kernel} / max_batch_tokens={budget}, num_blocks={num_blocks}"
    with engines_checked():
        outputs, preemptions = run_batch(
            model,
            prompts,
            greedy_config(MAX_NEW_TOKENS),
            page_size=4,
            max_batch_tokens=budget,
            num_blocks=num_blocks,
            return_logprobs=True,
        )
    assert preemptions, f"{context}: nothing was preempted"
    check_parity(model, prompts, outputs, [references.get(p) for p in prompts], context)
    check_logprobs(model, prompts, outputs, references, context)


def test_sparse_parity_with_offload(subject) -> None:
    """Preempted requests swap their rows (latent and indexer key) to the host tier and back."""
    name, model, prompts, references = subject
    num_blocks = tight_num_blocks(prompts, MAX_NEW_TOKENS, 4)
    with engines_checked() as engines:
        outputs, preemptions = run_batch(
            model,
            prompts,
            greedy_config(MAX_NEW_TOKENS),
            page_size=4,
            max_batch_tokens=16,
            num_blocks=num_blocks,
            cpu_offload_space=None,
        )
    (engine,) = engines
    assert preemptions and engine.offload is not None and engine.offload.swap_out_pages > 0, name
    assert engine.scheduler.recomputed.total == 0, name
    check_parity(model, prompts, outputs, [references.get(p) for p in prompts], f"{name} with offload")


def test_sparse_parity_with_prefix_hits(subject) -> None:
    name, model, _, references = subject
    check_shared_prefix_parity(model, references, f"{name} sharing", MAX_NEW_TOKENS)
