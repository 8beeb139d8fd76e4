"""Greedy parity on models whose layers attend with K/V head shapes their config does not state: the cache
is sized from what the support check's probe saw each layer pass (`kv/layer_groups.py: ObservedLayers`).

- JetMoE repeats its K/V once per routed expert (`num_experts_per_tok`) before attending: every layer
  passes twice the config's KV heads, tiled; the cache holds them once, before the repeat
  (attention/families/repeated_kv.py maps the query heads onto them).
- MiMo-V2-Flash doubles the KV heads of its sliding layers in code: its full and sliding layers get KV
  groups of different head shapes (window 8, shorter than most prompts); its V heads are 6 wide for 8-wide
  keys (the real model: 128 for 192), cached at their own size beside K in one row.

Each runs under the torch paged backends transformers lets it take (MiMo-V2-Flash: eager only) x page sizes {4, 16} x token budgets (5: chunked prefill; default),
under eviction (a cache just big enough for the largest request) and with prefix sharing; the engine's
integrity check runs after every step.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from conformance.common import (
    ReferenceCache,
    check_parity,
    check_parity_under_eviction,
    greedy_config,
    run_batch,
    tight_num_blocks,
)
from conformance.test_parity_offload import engines_checked
from conformance.test_parity_sliding import integrity_checked
from conformance.test_prefix_sharing import check_shared_prefix_parity
from tests.support.prompts import random_prompts
from transformers_cb import ContinuousBatchingConfig
from transformers_cb.engine.build import build_engine
from transformers_cb.kv.layer_groups import ObservedLayers
from transformers_cb.model_check.model_support import observed_layers_of

MAX_NEW_TOKENS = 10
VOCAB = 300
SMALL = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "bos_token_id": 1, "eos_token_id": 2}


# The plain implementation generate() runs (transformers refuses sdpa for MiMo-V2-Flash: its sinks).
PLAIN = {"jetmoe": "sdpa", "mimo_v2_flash": "eager"}


def _tiny(model_type: str, **overrides) -> PreTrainedModel:
    config = AutoConfig.for_model(model_type, **{**SMALL, **overrides})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.set_attn_implementation(PLAIN[model_type])
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


MODELS: dict[str, Callable[[], PreTrainedModel]] = {
    "jetmoe": lambda: _tiny(
        "jetmoe",
        num_key_value_heads=2,
        kv_channels=8,
        intermediate_size=32,
        num_local_experts=4,
        num_experts_per_tok=2,
    ),
    "mimo_v2_flash": lambda: _tiny(
        "mimo_v2_flash",
        num_attention_heads=4,
        intermediate_size=64,
        moe_intermediate_size=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        num_key_value_heads=2,
        head_dim=8,
        v_head_dim=6,
        sliding_window=8,
        layer_types=["full_attention", "sliding_attention"],
    ),
}
# What the probe sees each layer attend with, as the cache holds it: K's (KV heads, head dim) per layer (not
# the config's (2, 8) for MiMo-V2-Flash), V's head sizes, and JetMoE's repeat of its K/V heads.
OBSERVED = {
    "jetmoe": ObservedLayers(((2, 8), (2, 8)), (), (2, 2)),
    "mimo_v2_flash": ObservedLayers(((2, 8), (4, 8)), (6, 6), ()),
}
# KV bytes per token in float32: JetMoE's 2 heads of K and V (half of the repeated 4 heads), MiMo-V2-Flash's
# 8-wide K and 6-wide V (nothing padded to K's size).
BYTES_PER_TOKEN = {"jetmoe": 2 * 2 * 2 * 8 * 4, "mimo_v2_flash": (2 + 4) * (8 + 6) * 4}


@pytest.fixture(scope="module", params=sorted(MODELS))
def subject(request):
    model = MODELS[request.param]()
    prompts = random_prompts(6, VOCAB, 1, 30, seed=1)
    return request.param, model, prompts, ReferenceCache(model, MAX_NEW_TOKENS)


def test_the_cache_is_sized_from_the_probe(subject) -> None:
    name, model, _, _ = subject
    engine = build_engine(model, greedy_config(MAX_NEW_TOKENS), ContinuousBatchingConfig(page_size=4))
    observed = observed_layers_of(model)
    assert observed == OBSERVED[name]
    shapes = {
        layer: spec.head_shape for spec in engine.settings.cache.kv_groups for layer in spec.layer_indices
    }
    assert tuple(shapes[i] for i in range(2)) == OBSERVED[name].head_shapes
    assert engine.snapshot().kv_bytes_per_token == BYTES_PER_TOKEN[name]


@pytest.mark.parametrize("budget", [5, None], ids=lambda b: f"budget{b}")
@pytest.mark.parametrize("page_size", [4, 16], ids=lambda p: f"page{p}")
@pytest.mark.parametrize("backend", ["paged|sdpa", "paged|eager"])
def test_probed_shapes_parity(subject, backend: str, page_size: int, budget: int | None) -> None:
    name, model, prompts, references = subject
    if backend == "paged|sdpa" and PLAIN[name] != "sdpa":
        pytest.skip(f"transformers refuses sdpa-based implementations for {name}")
    context = f"{name} / {backend!r} / page_size={page_size}, max_batch_tokens={budget}"
    model.set_attn_implementation(backend)
    try:
        with integrity_checked() as steps:
            outputs, _ = run_batch(
                model, prompts, greedy_config(MAX_NEW_TOKENS), page_size=page_size, max_batch_tokens=budget
            )
    finally:
        model.set_attn_implementation(PLAIN[name])
    assert steps, "the engine never stepped"
    check_parity(model, prompts, outputs, [references.get(p) for p in prompts], context)


def test_probed_shapes_parity_under_eviction(subject) -> None:
    name, model, prompts, references = subject
    with integrity_checked():
        check_parity_under_eviction(model, prompts, references, f"{name} under eviction")


def test_probed_shapes_share_prefixes_and_match_generate(subject) -> None:
    name, model, _, references = subject
    check_shared_prefix_parity(model, references, f"{name} sharing", MAX_NEW_TOKENS)


def test_probed_shapes_parity_with_offload(subject) -> None:
    """Preempted requests swap their pages to the host tier and back (JetMoE's heads before the repeat,
    MiMo-V2-Flash's rows of K and V side by side): nothing is recomputed."""
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
    assert preemptions, f"{name}: nothing was preempted"
    assert engine.offload is not None and engine.offload.swap_out_pages > 0, name
    assert engine.scheduler.recomputed.total == 0, name
    check_parity(model, prompts, outputs, [references.get(p) for p in prompts], f"{name} with offload")


def test_probed_shapes_parity_without_the_native_kernel(subject, monkeypatch) -> None:
    """The torch kernels take every token (with the native kernel built, decodes and short chunks are its:
    MiMo-V2-Flash's rows of K and V then run through `attend`)."""
    name, model, prompts, references = subject
    monkeypatch.setenv("TRANSFORMERS_CB_NATIVE_KERNEL", "0")
    outputs, _ = run_batch(model, prompts, greedy_config(MAX_NEW_TOKENS), page_size=4, max_batch_tokens=16)
    check_parity(model, prompts, outputs, [references.get(p) for p in prompts], f"{name} without native")
