"""A tiny config of a model type, built from the type's own config class.

The class's defaults describe the real architecture; the tiny config keeps every feature of it and
shrinks only sizes: 2-4 layers chosen so that every distinct per-layer pattern (attention kind, MoE or
dense MLP, per-layer overrides) keeps a layer, small widths (hidden 64, 4 heads of 16, 2 KV heads),
a 256-token vocabulary, 4 experts with 2 active, small windows and chunks (so that the prompts cross
them). Soft-caps, sinks, routing, rotary settings and every flag are kept as the class sets them.

Shrinking works on the config's dict (sub-configs: text, vision, audio, encoder, decoder, ... are
shrunk with the same targets, so dimensions that must agree across them still agree) and rebuilds the
config with `from_dict`, so the class's own `__post_init__` derives what it derives.
"""

from __future__ import annotations

import math
from typing import Any

TARGET_LAYERS = 4  # at most; at least MIN_LAYERS
MIN_LAYERS = 2
WIDTH = 64
FFN = 128
EXPERT_FFN = 32
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 16
VOCAB = 256
EXPERTS = 4
ACTIVE_EXPERTS = 2
WINDOW = 8  # sliding windows, attention chunks: shorter than the prompts
# Stronger than the classes' usual 0.02: a tiny random model's attention then matters to its logits, so a
# missing bias, window or position shift changes the greedy tokens instead of hiding under near-ties.
INITIALIZER_RANGE = 0.1

# Exact keys: number-of-layer keys (the per-layer lists follow the chosen layers).
LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers")
OTHER_LAYER_COUNTS = ("encoder_layers", "decoder_layers", "depth", "num_decoder_layers", "num_encoder_layers")

EXACT_TARGETS: dict[str, int] = {
    # widths
    "hidden_size": WIDTH,
    "d_model": WIDTH,
    "n_embd": WIDTH,
    "n_embed": WIDTH,
    "embed_dim": WIDTH,
    "dim": WIDTH,
    "word_embed_proj_dim": WIDTH,
    "projection_dim": WIDTH,
    "out_hidden_size": WIDTH,
    # heads
    "num_attention_heads": HEADS,
    "n_head": HEADS,
    "n_heads": HEADS,
    "num_heads": HEADS,
    "encoder_attention_heads": HEADS,
    "decoder_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "num_kv_heads": KV_HEADS,
    "n_kv_heads": KV_HEADS,
    "multi_query_group_num": KV_HEADS,
    "head_dim": HEAD_DIM,
    "d_head": HEAD_DIM,
    "d_kv": HEAD_DIM,
    "kv_channels": HEAD_DIM,
    "attention_head_dim": HEAD_DIM,
    "rotary_dim": HEAD_DIM // 2,
    # multi-latent attention
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "qk_head_dim": 16,
    "v_head_dim": HEAD_DIM,
    "index_head_dim": HEAD_DIM,
    "index_n_heads": HEADS,
    # DeepSeek sparse attention: fewer selected keys than the prompts hold, so the selection matters
    "index_topk": WINDOW,
    "index_kpool": 4,  # GLM-5-next pools keys in blocks; the selected count stays a multiple of the block
    # MoE routing: kept, smaller
    "num_experts": EXPERTS,
    "num_local_experts": EXPERTS,
    "n_routed_experts": EXPERTS,
    "moe_num_experts": EXPERTS,
    "num_experts_per_tok": ACTIVE_EXPERTS,
    "top_k_experts": ACTIVE_EXPERTS,
    "moe_topk": ACTIVE_EXPERTS,
    "moe_k": ACTIVE_EXPERTS,
    "num_experts_per_token": ACTIVE_EXPERTS,  # Bailing-hybrid, Kimi-Linear
    "n_group": 1,
    "topk_group": 1,
    "num_expert_group": 1,
    "first_k_dense_replace": 1,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    # windows and chunks
    "sliding_window": WINDOW,
    "attention_chunk_size": WINDOW,
    # KV shared by later layers: one layer, so the tiny model still has it
    "num_kv_shared_layers": 1,
}


# Fields some classes leave None in their defaults although their model needs a value.
FILL_WHEN_NONE: dict[str, int] = {
    "head_dim": HEAD_DIM,
    "num_key_value_heads": HEADS,  # None means one KV head per query head
    "n_routed_experts": EXPERTS,
    "num_experts": EXPERTS,
    "num_experts_per_tok": ACTIVE_EXPERTS,
    "top_k_experts": ACTIVE_EXPERTS,
    "moe_intermediate_size": EXPERT_FFN,
}
SPECIAL_ID_SUFFIXES = ("_token_id", "_token_index", "_token_ids")


def target_for(key: str, value: Any) -> int | None:
    """The tiny value of one int field, or None to keep it."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        return None
    if key in EXACT_TARGETS:
        target = EXACT_TARGETS[key]
    elif key in OTHER_LAYER_COUNTS:
        target = MIN_LAYERS
    elif key.endswith(("intermediate_size", "ffn_dim", "ffn_hidden_size", "n_inner", "d_ff")):
        target = EXPERT_FFN if ("moe" in key or "expert" in key) else FFN
    elif "hidden_size" in key:
        target = WIDTH
    elif key.endswith("vocab_size"):
        target = VOCAB
    else:
        return None
    return min(value, target)


def _per_layer_keys(d: dict, num_layers: int) -> list[str]:
    """Keys of values with one entry per layer (lists, or pattern strings such as `M*-M`)."""
    keys = []
    for key, value in d.items():
        if key in ("architectures",) or key.endswith("_token_id"):
            continue
        is_list = isinstance(value, list) and num_layers > 1
        is_pattern = isinstance(value, str) and key.endswith("pattern")
        if (is_list or is_pattern) and len(value) == num_layers:
            keys.append(key)
    return keys


def _layer_overrides(d: dict) -> dict[int, dict]:
    overrides = d.get("per_layer_config") or {}
    return {int(k): v for k, v in overrides.items()}


def choose_layers(d: dict, num_layers: int) -> list[int]:
    """2-4 layer indices: the first layer of every distinct per-layer pattern, then the next layers."""
    keys = _per_layer_keys(d, num_layers)
    overrides = _layer_overrides(d)

    def signature(i: int) -> str:
        return repr([d[k][i] for k in keys]) + repr(sorted(overrides.get(i, {}).items()))

    chosen: list[int] = []
    seen: set[str] = set()
    for i in range(num_layers):
        sig = signature(i)
        if sig not in seen:
            seen.add(sig)
            chosen.append(i)
    chosen = chosen[:TARGET_LAYERS]
    extra = (i for i in range(num_layers) if i not in chosen)
    while len(chosen) < MIN_LAYERS:
        chosen.append(next(extra))
    return sorted(chosen)


def _scaled(key: str, value: Any, global_value: Any) -> Any:
    """A per-layer override shrunk in proportion to its global value (head_dim 512 over 256 -> 2x)."""
    target = target_for(key, global_value) if isinstance(global_value, int) else None
    if target is None or not isinstance(value, int) or isinstance(value, bool) or not global_value:
        return value
    return max(1, round(target * value / global_value))


def _shrink_override(override: dict, d: dict) -> dict:
    """One layer's overrides, scaled; a multi-head override (KV heads = heads) stays multi-head."""
    out = {k: _scaled(k, v, d.get(k)) for k, v in override.items()}
    kv, heads = override.get("num_key_value_heads"), override.get("num_attention_heads")
    if kv is not None and kv == heads:
        out["num_key_value_heads"] = out["num_attention_heads"]
    return out


def shrink_dict(d: dict, special_ids: dict[int, int] | None = None) -> dict:
    """A shrunk copy of one config dict (sub-config dicts shrunk recursively). `special_ids`: the
    renumbering of special token ids beyond the tiny vocabulary, shared by the whole config tree."""
    special_ids = {} if special_ids is None else special_ids
    out: dict[str, Any] = {}
    for key, value in d.items():
        if isinstance(value, dict) and "model_type" in value:
            out[key] = shrink_dict(value, special_ids)
        elif key.endswith(SPECIAL_ID_SUFFIXES):
            out[key] = _renumber(value, special_ids)
        elif key == "initializer_range" and isinstance(value, float):
            out[key] = INITIALIZER_RANGE
        elif value is None and key in FILL_WHEN_NONE:
            out[key] = FILL_WHEN_NONE[key]
        else:
            target = target_for(key, value)
            out[key] = value if target is None else target

    layer_key = next((k for k in LAYER_COUNT_KEYS if isinstance(d.get(k), int)), None)
    if layer_key is not None and d[layer_key] > 0:
        num_layers = d[layer_key]
        chosen = choose_layers(d, num_layers) if num_layers > MIN_LAYERS else list(range(num_layers))
        out[layer_key] = len(chosen)
        for key in _per_layer_keys(d, num_layers):
            picked = [d[key][i] for i in chosen]
            out[key] = "".join(picked) if isinstance(d[key], str) else picked
        overrides = _layer_overrides(d)
        if overrides:
            out["per_layer_config"] = {
                str(new): _shrink_override(overrides[old], d)
                for new, old in enumerate(chosen)
                if old in overrides
            }
        _remap_layer_indices(d, out, chosen, num_layers)
    _fix_consistency(d, out)
    for key in ("rope_parameters", "rope_scaling"):
        if key in out:
            out[key] = _shrink_rope(out[key], _head_dim(d), _head_dim(out))
    return out


def _head_dim(d: dict) -> int | None:
    head_dim = d.get("head_dim")
    if isinstance(head_dim, int) and head_dim > 0:
        return head_dim
    hidden, heads = d.get("hidden_size"), d.get("num_attention_heads")
    return hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None


def _split(total: int, parts: list[int]) -> list[int]:
    """`total` split in proportion to `parts`, each at least 1, summing exactly to `total`."""
    whole = sum(parts)
    out = [max(1, p * total // whole) for p in parts]
    out[-1] += total - sum(out)
    return out


def _shrink_rope(rope: Any, old_head_dim: int | None, new_head_dim: int | None) -> Any:
    """Multimodal rotary sections (`mrope_section`, ...) sum to half the rotary dims: scaled with the head."""
    if not isinstance(rope, dict) or not old_head_dim or not new_head_dim:
        return rope
    out = {}
    for key, value in rope.items():
        if isinstance(value, dict):
            out[key] = _shrink_rope(value, old_head_dim, new_head_dim)
        elif key.endswith("section") and isinstance(value, list) and all(isinstance(v, int) for v in value):
            out[key] = _split(max(len(value), sum(value) * new_head_dim // old_head_dim), value)
        else:
            out[key] = value
    return out


def _renumber(value: Any, special_ids: dict[int, int]) -> Any:
    """Special token ids beyond the tiny vocabulary move to its top (the same id to the same new id)."""
    if isinstance(value, list):
        return [_renumber(v, special_ids) for v in value]
    if not isinstance(value, int) or isinstance(value, bool) or 0 <= value < VOCAB:
        return value
    if value not in special_ids:
        special_ids[value] = VOCAB - 1 - len(special_ids)
    return special_ids[value]


def _remap_layer_indices(d: dict, out: dict, chosen: list[int], num_layers: int) -> None:
    """Lists of layer indices (`mlp_only_layers`, `attn_layer_indices`, ...) follow the chosen layers."""
    position = {old: new for new, old in enumerate(chosen)}
    for key, value in d.items():
        if "layer" not in key or not isinstance(value, list) or not value or len(value) == num_layers:
            continue
        if all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < num_layers for v in value):
            out[key] = [position[v] for v in value if v in position]


def _fix_consistency(d: dict, out: dict) -> None:
    """Keep the relations the classes check: multi-head stays multi-head (one KV head per query head),
    multi-query stays multi-query, grouped-query stays grouped; KV heads divide the heads."""
    heads, kv = d.get("num_attention_heads"), d.get("num_key_value_heads")
    if isinstance(heads, int) and isinstance(kv, int) and kv > 0:
        out["num_key_value_heads"] = (
            out["num_attention_heads"] if kv == heads else (1 if kv == 1 else KV_HEADS)
        )
    heads, kv = out.get("num_attention_heads"), out.get("num_key_value_heads")
    if isinstance(heads, int) and isinstance(kv, int) and kv > 0 and heads % kv:
        out["num_key_value_heads"] = math.gcd(heads, kv)
    # State-space heads span the expanded width: heads x head size = expand x hidden.
    for heads_key, dim_key, expand_key in (
        ("num_heads", "head_dim", "expand"),
        ("mamba_n_heads", "mamba_d_head", "mamba_expand"),
    ):
        n, expand, hidden = out.get(heads_key), d.get(expand_key), out.get("hidden_size")
        if all(isinstance(v, int) and v > 0 for v in (n, expand, hidden)) and dim_key in out:
            out[dim_key] = max(1, expand * hidden // n)
    # Falcon-H1 states its state-space width itself (`mamba_d_ssm`, else expand x hidden): keep it that.
    expand, hidden = d.get("mamba_expand"), out.get("hidden_size")
    if isinstance(out.get("mamba_d_ssm"), int) and isinstance(expand, int) and isinstance(hidden, int):
        out["mamba_d_ssm"] = expand * hidden
    # Multi-latent attention's rotary embedding is sized by `head_dim`, which the classes set to
    # `qk_rope_head_dim` (DeepSeek V3, Youtu, AXK1, LongCat): it stays the shrunk rotary width.
    if d.get("kv_lora_rank") is not None and d.get("head_dim") == d.get("qk_rope_head_dim"):
        out["head_dim"] = out.get("qk_rope_head_dim")
    # A V head size the class sets apart from K's (MiMo-V2-Flash: 128 for 192) stays apart, in proportion:
    # a tiny model whose V has K's size would not show whether V is cached at its own size.
    head_dim, v_head_dim = d.get("head_dim"), d.get("v_head_dim")
    if (
        d.get("kv_lora_rank") is None
        and isinstance(head_dim, int)
        and isinstance(v_head_dim, int)
        and head_dim > 0
        and v_head_dim != head_dim
        and isinstance(out.get("head_dim"), int)
    ):
        out["v_head_dim"] = max(1, round(out["head_dim"] * v_head_dim / head_dim))
    # A window or chunk at least as long as the model's context would never apply.
    for key in ("sliding_window", "attention_chunk_size"):
        value = out.get(key)
        if isinstance(value, int) and value <= 0:
            out[key] = None


# Attributes a model reads from its config that its config class does not declare (released checkpoints'
# configs carry them): the Qwen Omni thinkers' rotary index reads `vision_start_token_id`, declared only on
# the talker's config. The checkpoints' values, renumbered into the tiny vocabulary like every special id.
UNDECLARED_ATTRIBUTES: dict[str, dict[str, Any]] = {
    "qwen2_5_omni_thinker": {"vision_start_token_id": 151652},
    "qwen3_omni_moe_thinker": {"vision_start_token_id": 151652},
}


def tiny_config(model_type: str) -> Any:
    """The tiny config of `model_type` (raises what the config class raises)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    config = config_class.from_dict(
        shrink_dict({**config_class().to_dict(), **UNDECLARED_ATTRIBUTES.get(model_type, {})})
    )
    _add_rope_sections(config)
    return config


# Qwen2-VL's default multimodal rotary sections (in its modeling code, not its config): t, h, w halves.
DEFAULT_MROPE_SECTION = [16, 24, 24]


def _add_rope_sections(config: Any) -> None:
    """A config class that knows `mrope_section` but leaves it to its model's default (sized for the real
    head) gets sections that fit the tiny head: what the model would use, scaled."""
    subs = [config, *(getattr(config, name, None) for name in getattr(config, "sub_configs", {}) or {})]
    for sub in subs:
        if sub is None or "mrope_section" not in getattr(sub, "ignore_keys_at_rope_validation", ()):
            continue
        rope = getattr(sub, "rope_parameters", None)
        head_dim = _head_dim(sub.to_dict())
        if isinstance(rope, dict) and "mrope_section" not in rope and head_dim:
            rope["mrope_section"] = _split(head_dim // 2, DEFAULT_MROPE_SECTION)
