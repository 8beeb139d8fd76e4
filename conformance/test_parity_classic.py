"""Greedy parity on the classic families, whose attention modules compute attention themselves and run
through the paged cache by their adapters (attention/families/classic.py): Bloom (also its exact tensor-parallel
output path) and MPT with ALiBi (the kernels add the bias from positions; head counts that are not powers of
two, so the extra slopes are exercised), Falcon's ALiBi in its own bfloat16-rounded form, GPT-J
and CodeGen (rotary on part of the head), Falcon (multi-query, and the new decoder architecture's grouped
K/V), GPT-Neo (its local layers a sliding window of 5, shorter than most prompts), XGLM, OpenAI-GPT and
GPT-NeoX-Japanese.

Each runs a mixed batch (decodes beside prefill chunks) under the paged eager and SDPA kernels and the native
CPU kernel (when built), with a 5-token budget (chunked prefill), then under eviction (a cache just big
enough for the largest request: preemption and recompute), then with shared prefixes (prefix hits); the
engine's integrity check runs after every step.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, BlipTextLMHeadModel, PreTrainedModel

from conformance.common import (
    ReferenceCache,
    check_parity,
    check_parity_under_eviction,
    greedy_config,
    run_batch,
)
from conformance.test_parity_sliding import integrity_checked
from conformance.test_prefix_sharing import check_shared_prefix_parity
from tests.support.prompts import random_prompts
from transformers_cb.attention import mixed_paged, paged
from transformers_cb.attention.families.classic import classic_modules
from transformers_cb.attention.native.kernel import ENV_SWITCH, ensure_native_module

MAX_NEW_TOKENS = 10
VOCAB = 300

CONFIGS: dict[str, tuple[str, dict]] = {
    "bloom": ("bloom", {"hidden_size": 48, "n_layer": 2, "n_head": 3}),
    "bloom_exact_tp": (
        "bloom",
        {"hidden_size": 48, "n_layer": 2, "n_head": 3, "pretraining_tp": 2, "slow_but_exact": True},
    ),
    "mpt": ("mpt", {"d_model": 48, "n_heads": 6, "n_layers": 2, "max_seq_len": 128, "expansion_ratio": 2}),
    "gptj": ("gptj", {"n_embd": 32, "n_layer": 2, "n_head": 4, "rotary_dim": 4, "n_positions": 128}),
    "codegen": ("codegen", {"n_embd": 32, "n_layer": 2, "n_head": 4, "rotary_dim": 4, "n_positions": 128}),
    "falcon": ("falcon", {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}),
    # ALiBi in Falcon's own form (bfloat16 products of absolute positions, scaled); 6 heads: extra slopes.
    "falcon_alibi": (
        "falcon",
        {"hidden_size": 48, "num_hidden_layers": 2, "num_attention_heads": 6, "alibi": True},
    ),
    "falcon_grouped": (
        "falcon",
        {
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "new_decoder_architecture": True,
            "num_kv_heads": 2,
        },
    ),
    "gpt_neo": (
        "gpt_neo",
        {
            "hidden_size": 32,
            "num_layers": 2,
            "num_heads": 4,
            "attention_types": [[["global", "local"], 1]],
            "window_size": 5,
            "max_position_embeddings": 128,
        },
    ),
    "git": (
        "git",
        {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64},
    ),
    "blip_text": (
        "blip_text_model",
        {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64},
    ),
    "xglm": (
        "xglm",
        {"d_model": 32, "num_layers": 2, "attention_heads": 4, "ffn_dim": 64, "max_position_embeddings": 128},
    ),
    "openai-gpt": ("openai-gpt", {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 128}),
    "gpt_neox_japanese": (
        "gpt_neox_japanese",
        {
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "intermediate_multiple_size": 2,
            "max_position_embeddings": 128,
        },
    ),
}


def _tiny(name: str) -> PreTrainedModel:
    model_type, overrides = CONFIGS[name]
    config = AutoConfig.for_model(model_type, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, **overrides)
    torch.manual_seed(0)
    if (
        model_type == "blip_text_model"
    ):  # BLIP's text decoder alone: no auto class, no image to cross-attend to
        model = BlipTextLMHeadModel(config).eval()
    else:
        model = AutoModelForCausalLM.from_config(config).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def subject(request):
    model = _tiny(request.param)
    prompts = random_prompts(6, VOCAB, 1, 30, seed=1)
    return request.param, model, prompts, ReferenceCache(model, MAX_NEW_TOKENS)


@contextmanager
def backend(model: PreTrainedModel, name: str) -> Iterator[None]:
    """The paged backend the engine picks from the config's implementation (these classes cannot switch
    theirs: their attention modules do not read it), for the run only."""
    saved = model.config._attn_implementation
    model.config._attn_implementation = name
    try:
        yield
    finally:
        model.config._attn_implementation = saved


def test_every_attention_module_is_adapted(subject) -> None:
    name, model, _, _ = subject
    # BLIP's decoder layers also hold a cross-attention module of the same class (unused without an image).
    expected = 4 if name == "blip_text" else 2
    assert len(classic_modules(model)) == expected, (
        f"{name}: {type(model).__name__} has unadapted attention modules"
    )


KERNELS = [("paged|eager", "torch"), ("paged|sdpa", "torch"), ("paged|sdpa", "native")]


@pytest.mark.parametrize(("implementation", "kernel"), KERNELS, ids=lambda v: v)
def test_classic_parity(subject, implementation: str, kernel: str, monkeypatch) -> None:
    name, model, prompts, references = subject
    if kernel == "native":
        if ensure_native_module(timeout=600) is None:
            pytest.skip("the native kernel cannot be built here")
    else:
        monkeypatch.setenv(ENV_SWITCH, "0")
    context = f"{name} / {implementation!r} / {kernel} kernel, page_size=4, max_batch_tokens=5"
    with backend(model, implementation), integrity_checked() as steps:
        outputs, _ = run_batch(model, prompts, greedy_config(MAX_NEW_TOKENS), page_size=4, max_batch_tokens=5)
    assert steps, "the engine never stepped"
    check_parity(model, prompts, outputs, [references.get(p) for p in prompts], context)


def test_classic_parity_under_eviction(subject) -> None:
    name, model, prompts, references = subject
    with integrity_checked():
        check_parity_under_eviction(model, prompts, references, f"{name} under eviction")


def test_classic_share_prefixes_and_match_generate(subject) -> None:
    name, model, _, references = subject
    check_shared_prefix_parity(model, references, f"{name} sharing", MAX_NEW_TOKENS)


def test_falcon_form_runs_the_native_kernel_s_rows_through_torch(monkeypatch) -> None:
    """The native kernel adds only the relative ALiBi form: with it on, Falcon's layers attend the tokens it
    was planned for through the torch kernel (attention/mixed_paged.py), never through it, and stay exact."""
    if ensure_native_module(timeout=600) is None:
        pytest.skip("the native kernel cannot be built here")
    model = _tiny("falcon_alibi")
    prompts = random_prompts(4, VOCAB, 1, 30, seed=2)
    used: list[int] = []
    torch_rows = mixed_paged._attend_native_rows

    def counted(*args):
        used.append(1)
        return torch_rows(*args)

    def refused(*args, **kwargs):
        raise AssertionError("the native kernel ran a layer of Falcon's ALiBi form")

    monkeypatch.setattr(mixed_paged, "_attend_native_rows", counted)
    monkeypatch.setattr(mixed_paged, "native_paged_attention", refused)
    monkeypatch.setattr(paged, "native_paged_attention", refused)
    monkeypatch.setattr(paged, "native_paged_attention_op", refused)
    monkeypatch.setattr(paged, "native_layer_attention", refused)
    with backend(model, "paged|sdpa"):
        outputs, _ = run_batch(model, prompts, greedy_config(MAX_NEW_TOKENS), page_size=4, max_batch_tokens=5)
    assert used, "no step had tokens planned for the native kernel"
    references = ReferenceCache(model, MAX_NEW_TOKENS)
    check_parity(model, prompts, outputs, [references.get(p) for p in prompts], "falcon_alibi / native rows")
