"""Shared test helpers: tiny seeded random models and a plain-`generate()` reference."""

from __future__ import annotations

import random

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

TINY_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 300,
    "max_position_embeddings": 512,
}
VOCAB_SIZE = TINY_SHAPE["vocab_size"]


def _build(config_cls, model_cls, attn_implementation: str, seed: int, **overrides) -> PreTrainedModel:
    config = config_cls(**{**TINY_SHAPE, **overrides})
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    return model.to(torch.float32)


def tiny_llama(attn_implementation: str = "sdpa", seed: int = 0, **overrides) -> PreTrainedModel:
    return _build(LlamaConfig, LlamaForCausalLM, attn_implementation, seed, **overrides)


def tiny_qwen2(attn_implementation: str = "sdpa", seed: int = 0, **overrides) -> PreTrainedModel:
    return _build(Qwen2Config, Qwen2ForCausalLM, attn_implementation, seed, **overrides)


def tiny_qwen3(attn_implementation: str = "sdpa", seed: int = 0, **overrides) -> PreTrainedModel:
    overrides.setdefault("head_dim", 16)
    return _build(Qwen3Config, Qwen3ForCausalLM, attn_implementation, seed, **overrides)


def tiny_phi3(attn_implementation: str = "sdpa", seed: int = 0, **overrides) -> PreTrainedModel:
    overrides.setdefault("pad_token_id", 0)
    overrides.setdefault("bos_token_id", 1)
    overrides.setdefault("eos_token_id", 2)
    return _build(Phi3Config, Phi3ForCausalLM, attn_implementation, seed, **overrides)


TINY_MODELS = {"llama": tiny_llama, "qwen2": tiny_qwen2, "qwen3": tiny_qwen3, "phi3": tiny_phi3}


def random_prompts(lengths: list[int], seed: int = 0, low: int = 3) -> list[list[int]]:
    """Prompts of the given lengths with token ids in [low, vocab) (avoiding bos/eos ids)."""
    rng = random.Random(seed)
    return [[rng.randrange(low, VOCAB_SIZE) for _ in range(n)] for n in lengths]


@torch.inference_mode()
def greedy_reference(
    model: PreTrainedModel,
    prompt: list[int],
    max_new_tokens: int,
    eos_token_id: int | list[int] | None = None,
) -> list[int]:
    """Greedy tokens of plain `model.generate()` on `prompt` alone (eos included when hit)."""
    input_ids = torch.tensor([prompt], dtype=torch.long, device=model.device)
    kwargs = {}
    if eos_token_id is not None:
        kwargs["eos_token_id"] = eos_token_id
    output = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
        **kwargs,
    )
    return output[0, len(prompt) :].tolist()
