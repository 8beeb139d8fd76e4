"""The int8 KV cache's end-to-end reference: `generate()` on a copy of the model whose attention reads each
token's K/V rounded as the int8 pages hold them (`memory.kv_quant.round_trip` per token and KV head, then
transformers' own SDPA attention). The engine with `kv_cache_dtype="int8"` equals it up to near-ties (its
K/V are computed in other product shapes, so a value at a rounding boundary may land one step apart); plain
`generate()` it only approaches (docs/quantization.md, "int8 KV cache")."""

from __future__ import annotations

import copy

from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from transformers_cb.memory.kv_quant import round_trip

INT8_KV_SDPA = "int8_kv_sdpa"


def int8_kv_sdpa(module, query, key, value, attention_mask, **kwargs):
    """SDPA over K/V `[B, Hkv, L, D]` rounded per (token, KV head) as the int8 cache stores them."""
    return sdpa_attention_forward(module, query, round_trip(key), round_trip(value), attention_mask, **kwargs)


AttentionInterface.register(INT8_KV_SDPA, int8_kv_sdpa)
AttentionMaskInterface.register(INT8_KV_SDPA, sdpa_mask)


def int8_reference_model(model: PreTrainedModel) -> PreTrainedModel:
    """A copy of `model` (its own weights) whose `generate()` attends int8-rounded K/V."""
    reference = copy.deepcopy(model)
    reference.config._attn_implementation = INT8_KV_SDPA
    return reference
