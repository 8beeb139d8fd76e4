"""The one tiny-model builder of the tests and the conformance suite: seeded random weights, fp32, eval.

Two shapes build on it. `tiny_llama` / `tiny_qwen2` / `tiny_qwen3` / `tiny_phi3` (`TINY_SHAPE`, vocab 300,
the model's own generation config) serve the unit tests; `build_tiny_model(family)` (`FAMILY_SHAPE` plus a
per-family table, eos disabled) serves the parity suite, with the sliding-window and hybrid families.
The weights depend only on the seed and the config, never on the attention implementation.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import (
    Cohere2Config,
    Cohere2ForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    Gemma4ForCausalLM,
    Gemma4TextConfig,
    GptOssConfig,
    GptOssForCausalLM,
    Llama4ForCausalLM,
    Llama4TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    StableLmConfig,
    StableLmForCausalLM,
)

# architecture -> (config class, model class)
ARCHITECTURES: dict[str, tuple[type, type]] = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "phi3": (Phi3Config, Phi3ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "gemma2": (Gemma2Config, Gemma2ForCausalLM),
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM),
    "gemma4": (Gemma4TextConfig, Gemma4ForCausalLM),
    "cohere2": (Cohere2Config, Cohere2ForCausalLM),
    "gpt_oss": (GptOssConfig, GptOssForCausalLM),
    "stablelm": (StableLmConfig, StableLmForCausalLM),
    "llama4": (Llama4TextConfig, Llama4ForCausalLM),
}


def build_model(
    architecture: str, seed: int = 0, attn_implementation: str | None = None, **config: Any
) -> PreTrainedModel:
    """A random `architecture` model of `config` (fp32, eval); the weights depend only on `seed` and `config`.
    `attn_implementation`, if given, is set on the config before the model is built."""
    config_class, model_class = ARCHITECTURES[architecture]
    model_config = config_class(**config)
    if attn_implementation is not None:
        model_config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    return model_class(model_config).to(torch.float32).eval()


# -- the unit tests' models ------------------------------------------------------------------------
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


def tiny_llama(attn_implementation: str | None = "sdpa", seed: int = 0, **overrides) -> PreTrainedModel:
    return build_model("llama", seed, attn_implementation, **{**TINY_SHAPE, **overrides})


def tiny_qwen2(attn_implementation: str | None = "sdpa", seed: int = 0, **overrides) -> PreTrainedModel:
    return build_model("qwen2", seed, attn_implementation, **{**TINY_SHAPE, **overrides})


def tiny_qwen3(attn_implementation: str | None = "sdpa", seed: int = 0, **overrides) -> PreTrainedModel:
    overrides.setdefault("head_dim", 16)
    return build_model("qwen3", seed, attn_implementation, **{**TINY_SHAPE, **overrides})


def tiny_phi3(attn_implementation: str | None = "sdpa", seed: int = 0, **overrides) -> PreTrainedModel:
    overrides.setdefault("pad_token_id", 0)
    overrides.setdefault("bos_token_id", 1)
    overrides.setdefault("eos_token_id", 2)
    return build_model("phi3", seed, attn_implementation, **{**TINY_SHAPE, **overrides})


# -- dynamic rotary embeddings (issue 48): LongRoPE and dynamic NTK, attention sharpened -------------------
ROPE_THRESHOLD = 32  # LongRoPE's original_max_position_embeddings; dynamic NTK's max_position_embeddings
LONGROPE_PARAMETERS = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "short_factor": [1.0] * 8,  # head_dim 16: 8 frequencies
    "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0],
    "original_max_position_embeddings": ROPE_THRESHOLD,
}


def sharpen_attention(model: PreTrainedModel, qk: float = 40.0, vo: float = 10.0) -> PreTrainedModel:
    """Scale every layer's query and key projections by `qk` (sharp attention: another rotation moves the
    argmax key) and its value and output projections by `vo` (attention outweighs the residual), so that
    a wrong rotary frequency set changes the tokens. Phi-3's fused `qkv_proj` rows: Q, then K, then V."""
    with torch.no_grad():
        for layer in model.model.layers:
            attention = layer.self_attn
            if hasattr(attention, "qkv_proj"):
                head_dim = attention.head_dim
                q_rows = model.config.num_attention_heads * head_dim
                k_rows = model.config.num_key_value_heads * head_dim
                attention.qkv_proj.weight[: q_rows + k_rows] *= qk
                attention.qkv_proj.weight[q_rows + k_rows :] *= vo
            else:
                attention.q_proj.weight *= qk
                attention.k_proj.weight *= qk
                attention.v_proj.weight *= vo
            attention.o_proj.weight *= vo
    model.generation_config.eos_token_id = None  # every request runs to its token limit
    return model


def tiny_phi3_longrope(attn_implementation: str | None = "sdpa", seed: int = 0) -> PreTrainedModel:
    """Phi-3 with LongRoPE switching at 32 tokens (its `generate()` recomputes the cache there)."""
    model = tiny_phi3(
        attn_implementation,
        seed,
        max_position_embeddings=64,
        original_max_position_embeddings=ROPE_THRESHOLD,
        rope_parameters=dict(LONGROPE_PARAMETERS),
    )
    return sharpen_attention(model)


def tiny_llama_longrope(attn_implementation: str | None = "sdpa", seed: int = 0) -> PreTrainedModel:
    """Llama with LongRoPE switching at 32 tokens (no recompute: each call picks its set)."""
    model = tiny_llama(
        attn_implementation, seed, max_position_embeddings=64, rope_parameters=dict(LONGROPE_PARAMETERS)
    )
    return sharpen_attention(model)


def tiny_llama_dynamic(attn_implementation: str | None = "sdpa", seed: int = 0) -> PreTrainedModel:
    """Llama with dynamic NTK scaling past its 32 native positions. Its rotary embedding is stateful:
    a reference is a fresh model's `generate()`."""
    model = tiny_llama(
        attn_implementation,
        seed,
        max_position_embeddings=ROPE_THRESHOLD,
        rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0},
    )
    return sharpen_attention(model)


ROPE_MODELS = {
    "phi3_longrope": tiny_phi3_longrope,
    "llama_longrope": tiny_llama_longrope,
    "llama_dynamic": tiny_llama_dynamic,
}


TINY_MODELS = {"llama": tiny_llama, "qwen2": tiny_qwen2, "qwen3": tiny_qwen3, "phi3": tiny_phi3}


class LlamaIgnoringLogitsToKeep(LlamaForCausalLM):
    """A forward that computes logits for every position whatever `logits_to_keep` says (as Qwen2.5-Omni's
    thinker or VideoLLaMA3's outer class do): the runner must select the rows itself."""

    def forward(self, *args, logits_to_keep=0, **kwargs):
        return super().forward(*args, **kwargs)


def tiny_llama_ignoring_logits_to_keep(
    attn_implementation: str | None = "sdpa", seed: int = 0, **overrides
) -> PreTrainedModel:
    model_config = LlamaConfig(**{**TINY_SHAPE, **overrides})
    if attn_implementation is not None:
        model_config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    return LlamaIgnoringLogitsToKeep(model_config).to(torch.float32).eval()


def tiny_llama_without_eos(**overrides) -> PreTrainedModel:
    """`tiny_llama` whose generation config has no eos: every request runs to its token limit."""
    model = tiny_llama(**overrides)
    model.generation_config.eos_token_id = None
    return model


# -- the parity suite's model families -------------------------------------------------------------
BACKENDS = ("paged|sdpa", "paged|eager", "sdpa")
FAMILIES = ("llama", "qwen2", "qwen3", "phi3", "stablelm")

BOS, EOS, PAD = 1, 2, 0
SLIDING_WINDOW = 8
CHUNK_SIZE = 8  # Llama 4's attention_chunk_size
FAMILY_SHAPE = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "max_position_embeddings": 512,
    "bos_token_id": BOS,
    "eos_token_id": EOS,
    "pad_token_id": PAD,  # must be inside the vocabulary (Phi3's default is not)
}
# family -> (architecture, family-specific config arguments)
FAMILY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {"vocab_size": 320}),
    "qwen2": ("qwen2", {"vocab_size": 384, "use_sliding_window": False}),
    # head_dim deliberately != hidden_size / num_heads, so the cache must take head_dim from the config.
    "qwen3": ("qwen3", {"vocab_size": 448, "head_dim": 32}),
    "phi3": ("phi3", {"vocab_size": 512}),
    # StableLM: partial rotary (a quarter of each head), LayerNorm, and decoder layers that call their
    # attention without the forward's kwargs (the step's metadata arrives through the runner's context).
    "stablelm": ("stablelm", {"vocab_size": 320}),
    # Sliding-window and hybrid families, all with a window (8) shorter than most test prompts.
    # Mistral: every layer sliding (no layer_types; the model's own convention).
    "mistral": ("mistral", {"vocab_size": 320, "sliding_window": SLIDING_WINDOW}),
    # Qwen2 with use_sliding_window: layers from max_window_layers on are sliding (layer 0 full, 1 sliding).
    "qwen2_sliding": (
        "qwen2",
        {
            "vocab_size": 384,
            "use_sliding_window": True,
            "sliding_window": SLIDING_WINDOW,
            "max_window_layers": 1,
        },
    ),
    # Gemma 2: sliding/full alternating, attention logit softcap 50, final logit softcap 30, and a
    # query_pre_attn_scalar (256) that makes the scale differ from head_dim ** -0.5.
    "gemma2": ("gemma2", {"vocab_size": 320, "sliding_window": SLIDING_WINDOW, "head_dim": 16}),
    # Gemma 3 text: 5 sliding : 1 full, local RoPE base on sliding layers.
    "gemma3": (
        "gemma3",
        {"vocab_size": 320, "sliding_window": SLIDING_WINDOW, "head_dim": 16, "num_hidden_layers": 6},
    ),
    # Gemma 4 text: per-layer head shapes (sliding layers 2 KV heads of 16, full layers 1 KV head of 32,
    # keys reused as values), so each layer kind is its own KV group with its own head shape; the last
    # two layers read the first two's K/V (num_kv_shared_layers).
    "gemma4": (
        "gemma4",
        {
            "vocab_size": 320,
            "sliding_window": SLIDING_WINDOW,
            "head_dim": 16,
            "global_head_dim": 32,
            "num_global_key_value_heads": 1,
            "attention_k_eq_v": True,
            "num_hidden_layers": 4,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
            "num_kv_shared_layers": 2,
            "hidden_size_per_layer_input": 8,
            "vocab_size_per_layer_input": 320,
        },
    ),
    # Cohere2: 3 sliding : 1 full, RoPE on sliding layers only.
    "cohere2": ("cohere2", {"vocab_size": 320, "sliding_window": SLIDING_WINDOW, "num_hidden_layers": 4}),
    # GPT-OSS: sliding/full alternating with attention sinks (s_aux), a tiny MoE.
    "gpt_oss": (
        "gpt_oss",
        {
            "vocab_size": 320,
            "sliding_window": SLIDING_WINDOW,
            "head_dim": 16,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
    ),
    # Llama 4 text: 3 chunked layers (RoPE, attention chunks of 8) : 1 full NoPE layer whose queries are
    # scaled by a temperature of their position (floor_scale 4, attn_scale 1: it changes from the fourth
    # token on, so a step's wrong numbering would change the tokens), a tiny MoE.
    "llama4": (
        "llama4",
        {
            "vocab_size": 320,
            "head_dim": 16,
            "num_hidden_layers": 4,
            "attention_chunk_size": CHUNK_SIZE,
            "intermediate_size": 64,
            "intermediate_size_mlp": 128,
            "num_local_experts": 4,
            "num_experts_per_tok": 1,
            "floor_scale": 4,
            "attn_scale": 1.0,
        },
    ),
}
SLIDING_FAMILIES = ("mistral", "qwen2_sliding", "gemma2", "gemma3", "gemma4", "cohere2", "gpt_oss")
# transformers refuses `sdpa` for these (softcap / sinks): their plain implementation is eager.
EAGER_ONLY_FAMILIES = ("gemma2", "gpt_oss")


def plain_implementation(family: str) -> str:
    return "eager" if family in EAGER_ONLY_FAMILIES else "sdpa"


@contextmanager
def using_backend(model: PreTrainedModel, family: str, attn_implementation: str) -> Iterator[PreTrainedModel]:
    """`model` switched to `attn_implementation` for the block, then back to the family's plain one."""
    model.set_attn_implementation(attn_implementation)
    try:
        yield model
    finally:
        model.set_attn_implementation(plain_implementation(family))


def backends_for(family: str) -> tuple[str, ...]:
    """The attention implementations a family runs: paged and plain (switched to paged for the run)."""
    return ("paged|eager", "eager") if family in EAGER_ONLY_FAMILIES else BACKENDS


def build_tiny_model(
    family: str, seed: int = 0, attn_implementation: str | None = None, **overrides
) -> PreTrainedModel:
    """A tiny random model of `family` (fp32, eval), eos disabled in its generation config.
    `attn_implementation` defaults to the family's plain implementation (sdpa, or eager where
    transformers refuses sdpa)."""
    attn_implementation = attn_implementation or plain_implementation(family)
    architecture, extra = FAMILY_CONFIGS[family]
    model = build_model(architecture, seed, **{**FAMILY_SHAPE, **extra, **overrides})
    model.set_attn_implementation(attn_implementation)
    model.generation_config.bos_token_id = BOS
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = None
    return model


def vocab_size(model: PreTrainedModel) -> int:
    return model.config.get_text_config().vocab_size


def first_layers(model: PreTrainedModel, num_layers: int = 1) -> PreTrainedModel:
    """A draft model for `model`: a copy keeping its embeddings, its first `num_layers` decoder layers, its
    final norm and head (so its greedy tokens often agree with the model's: speculation accepts some)."""
    assistant = copy.deepcopy(model)
    assistant.model.layers = torch.nn.ModuleList(list(assistant.model.layers)[:num_layers])
    assistant.config.num_hidden_layers = num_layers
    if getattr(assistant.config, "layer_types", None):
        assistant.config.layer_types = assistant.config.layer_types[:num_layers]
    return assistant
