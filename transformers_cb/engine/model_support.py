"""Which models continuous batching can run, decided from the config before anything is allocated.

Supported: decoder-only causal LMs whose layers are full attention or sliding-window
attention (with logit softcapping and attention sinks where the model applies them).
Refused, with the model type and what is missing:
- encoder-decoder models (the cache holds one self-attention KV stream per request);
- state-space and linear-attention hybrids (Mamba, Jamba, Qwen3-Next, ...): their
  recurrent state is not a paged KV cache;
- attention the kernels do not implement: chunked (local block) attention,
  bidirectional sliding windows, multi-latent attention with its own value size,
  or any unknown `layer_types` entry (`kv/layer_groups.py`).
"""

from __future__ import annotations

from typing import Any, cast

from ..kv.layer_groups import kv_groups_from_config

# Model types whose decoder mixes attention with recurrent (state-space / linear-attention) blocks.
RECURRENT_MODEL_TYPES = frozenset(
    {
        "bamba",
        "falcon_h1",
        "falcon_mamba",
        "granitemoehybrid",
        "jamba",
        "lfm2",
        "lfm2_moe",
        "mamba",
        "mamba2",
        "minimax",
        "nemotron_h",
        "plamo2",
        "qwen3_next",
        "recurrent_gemma",
        "rwkv",
        "xlstm",
        "zamba",
        "zamba2",
    }
)
# Config attributes that only recurrent hybrids carry.
RECURRENT_CONFIG_ATTRIBUTES = (
    "layers_block_type",
    "hybrid_override_pattern",
    "attn_layer_indices",
    "mamba_expand",
)


def _refuse(model_type: str, missing: str) -> None:
    raise NotImplementedError(f"continuous batching cannot run model_type={model_type!r}: {missing}")


def check_model_supported(config: Any) -> None:
    """Raise `NotImplementedError` naming the model type and what is missing, or return."""
    text_config = config.get_text_config()
    # Configs name their type as a str class attribute (`PretrainedConfig.model_type`).
    model_type = cast(str, getattr(text_config, "model_type", None) or getattr(config, "model_type", "?"))
    if getattr(config, "is_encoder_decoder", False):
        _refuse(model_type, "encoder-decoder models are not supported (decoder-only causal LMs only)")
    if model_type in RECURRENT_MODEL_TYPES or any(
        getattr(text_config, name, None) is not None for name in RECURRENT_CONFIG_ATTRIBUTES
    ):
        _refuse(
            model_type,
            "state-space / linear-attention layers keep a recurrent state, not a paged KV cache; "
            "only full and sliding-window attention layers are supported",
        )
    if getattr(text_config, "attention_chunk_size", None) is not None:
        _refuse(model_type, "chunked (local block) attention is not implemented by the paged kernels")
    if getattr(text_config, "use_bidirectional_attention", False):
        _refuse(model_type, "bidirectional attention is not causal generation")
    if getattr(text_config, "kv_lora_rank", None) is not None:
        _refuse(model_type, "multi-latent attention (kv_lora_rank) needs its own cache layout")
    kv_groups_from_config(config)  # raises on layer types the kernels do not know
