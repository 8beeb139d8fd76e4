"""KV cache layer groups: which layers share a page policy, read from the model config.

Layers are grouped by attention type. Each group has its own page pool and
page policy (pages of the same `page_size`), and a request holds one page list
per group. Full-attention layers keep every token; sliding-window layers only
the last `sliding_window` tokens (see `page_policies.SlidingWindowPolicy`); chunked-attention
layers (Llama 4's `attention_chunk_size`) only the current chunk's tokens (see
`page_policies.ChunkedAttentionPolicy`).

Where the type of each layer comes from:
- `config.layer_types` when present (Gemma 2/3, Qwen2, Cohere2, GPT-OSS, ...);
- otherwise `config.sliding_window` (with `use_sliding_window` when the config
  has it) makes every layer sliding: that is Mistral's convention.
Layers that keep a fixed-size recurrent state instead of a growing KV (transformers' `linear_attention`
and `conv` layer types: gated delta rule, Mamba, short convolutions) belong to no KV group: their state
lives in per-request state slots (memory/state_cache.py). transformers' `hybrid` layers hold both a state
and full-attention KV (`hybrid_sliding`: sliding KV); `moe` / `mlp` layers hold nothing. Every other layer
type is refused before anything is allocated.

Per-layer head shapes (transformers' `per_layer_config`, e.g. Gemma 4: head_dim 256 and 8 KV heads
on sliding layers, 512 and 1 on full ones): a group is keyed by (attention kind, window, KV heads,
head dim), so layers of different shapes get their own groups, each with its head shape
(`KVGroupSpec.head_shape`); read per layer (`layer_head_shapes`), never globally, where transformers
raises `AmbiguousGlobalPerLayerAttributeError`.

Multi-latent attention (DeepSeek V2/V3, MiniCPM3, Kimi, ...: a config with `kv_lora_rank`): every KV group
is a latent group (`KVGroupSpec.latent`), whose pages hold one compressed vector per token and layer, the
`kv_lora_rank` latent and the `qk_rope_head_dim` rotary key, as one head of their summed width and no
separate V (attention/families/latent.py decompresses or absorbs it); its page policy is its kind's, like any group's.

What the model's forward shows overrides the config (`ObservedLayers`, learned by model_check's probe):
the (KV heads, head dim) each layer's attention call really passes (MiMo-V2-Flash's sliding layers have
twice the config's KV heads), a V head size other than K's (MiMo-V2-Flash: 128 against 192; the group's
pages then hold K and V of a token side by side in one row, `KVGroupSpec.value_dim`), and K/V a layer tiles
over its query heads before attending (JetMoE repeats its K/V once per routed expert: the group caches
them once, `KVGroupSpec.kv_repeat`, and attention/families/repeated_kv.py maps the query heads onto them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..invariants import check

if TYPE_CHECKING:
    from transformers import PretrainedConfig

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
CHUNKED_ATTENTION = "chunked_attention"
KNOWN_LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION, CHUNKED_ATTENTION)
# DeepSeek sparse attention's layer type (an indexer picks each query's keys): full attention over latent
# pages whose rows carry the indexer's key too (`KVGroupSpec.index_dim`; attention/families/sparse_index.py).
INDEXED_ATTENTION = "indexed_attention"
# transformers' layer types (cache_utils: `DYNAMIC_LAYER_TYPE_MAPPING`) with a recurrent state, and the
# attention kind of their KV (None: no KV at all).
STATE_LAYER_TYPES: dict[str, str | None] = {
    "linear_attention": None,
    "conv": None,
    "hybrid": FULL_ATTENTION,
    "hybrid_sliding": SLIDING_ATTENTION,
}
# Families whose every layer is a recurrence and whose config names no layer types (RWKV, xLSTM: their
# recurrences are model-owned, runner/states/own_state.py): every layer is a `linear_attention` state layer.
RECURRENT_ONLY_MODEL_TYPES = frozenset({"rwkv", "xlstm"})
# Layer types with neither KV nor state (a feed-forward block in a layer list of its own).
STATELESS_LAYER_TYPES = frozenset({"moe", "mlp"})
# The per-layer attributes (`per_layer_config`) that only change a layer's KV head shape.
HEAD_SHAPE_ATTRIBUTES = frozenset({"head_dim", "num_key_value_heads"})


@dataclass(frozen=True)
class ObservedLayers:
    """What a model's forward showed of its layers, where that overrides its config (model_check's probe).

    `head_shapes`: (KV heads, head dim) of each layer's K as the cache holds it (empty: the config's); why:
    the cache must hold what the kernels are given, and some models state other shapes than they attend
    with. `value_dims`: each layer's V head size where some layer's differs from its K's (empty: V has K's
    size). `kv_repeats`: how many times each layer tiles its K/V heads before the attention call (JetMoE:
    once per routed expert; `head_shapes` then counts the heads before the repeat; empty: none)."""

    head_shapes: tuple[tuple[int, int], ...] = ()
    value_dims: tuple[int, ...] = ()
    kv_repeats: tuple[int, ...] = ()


@dataclass(frozen=True)
class KVGroupSpec:
    """One KV cache group: its attention type, its layers, and its window (None = full attention).

    `attention_chunk_size`: a chunked group's chunk (a query at `q` reads keys `[q // C * C, q]`); None
    for the other kinds. `head_shape`: (KV heads, head dim) of the group's layers when the model's layers
    differ in head shape; None: the model's one shape (`memory.sizing.ModelShape`). `latent`: a latent
    group's (kv_lora_rank, qk_rope_head_dim): its pages hold one latent row per token and layer (one head
    of their summed width, no V), attended by attention/families/latent.py; its page policy is its kind's.
    `value_dim`: the V head size of a group whose V is not K's size (None: K's); a page then holds one
    stream whose rows are K's `head_dim` values followed by V's (`memory.kv_cache.layer_views` splits
    them), so nothing is padded. `kv_repeat`: the times its layers tile their K/V heads over the query
    heads before attending (JetMoE); the pages hold the heads before the repeat. `index_dim`: a latent
    group of DeepSeek sparse attention layers: each row's latent is followed by the indexer's key of the token
    (`index_head_dim` values), which selects each query's keys (attention/families/sparse_index.py)."""

    kind: str
    layer_indices: tuple[int, ...]
    sliding_window: int | None = None
    head_shape: tuple[int, int] | None = None
    attention_chunk_size: int | None = None
    # (kv_lora_rank, qk_rope_head_dim) of a latent group (multi-latent attention); None: K/V pages.
    latent: tuple[int, int] | None = None
    value_dim: int | None = None
    kv_repeat: int = 1
    # DeepSeek sparse attention: the indexer's key size (`index_head_dim`), stored after each latent row.
    index_dim: int | None = None

    @property
    def span(self) -> int | None:
        """The most keys one query reads (its window, or its chunk); None: every key before it (full
        attention). Why one number: pages held, ring widths and sizing only need this bound."""
        return self.sliding_window if self.sliding_window is not None else self.attention_chunk_size

    @property
    def name(self) -> str:
        name = self.kind
        if self.sliding_window is not None:
            name = f"{self.kind}(window={self.sliding_window})"
        elif self.attention_chunk_size is not None:
            name = f"{self.kind}(chunk={self.attention_chunk_size})"
        if self.latent is not None:
            index = "" if self.index_dim is None else f", indexer key={self.index_dim}"
            return f"{name}[latent={self.latent[0]}+{self.latent[1]}{index}]"
        if self.head_shape is not None:
            value = "" if self.value_dim is None else f", value dim={self.value_dim}"
            repeat = "" if self.kv_repeat == 1 else f", repeated x{self.kv_repeat}"
            name = f"{name}[heads={self.head_shape[0]}, dim={self.head_shape[1]}{value}{repeat}]"
        return name

    @property
    def kv_streams(self) -> int:
        """Tensors a page holds per layer: K and V (2), or one row per token: the latent alone, or K and V
        side by side when V's head size is not K's (1)."""
        return 1 if self.latent is not None or self.value_dim is not None else 2


def latent_shape_of(text_config: PretrainedConfig) -> tuple[int, int] | None:
    """(kv_lora_rank, qk_rope_head_dim) of a multi-latent attention model's config; None for any other."""
    rank = getattr(text_config, "kv_lora_rank", None)
    if rank is None:
        return None
    return int(rank), int(getattr(text_config, "qk_rope_head_dim", None) or 0)


def layer_types_of(text_config: PretrainedConfig) -> list[str]:
    """The attention type of every decoder layer, following the model's own conventions."""
    num_layers = text_config.num_hidden_layers
    if getattr(text_config, "model_type", None) in RECURRENT_ONLY_MODEL_TYPES:
        return ["linear_attention"] * num_layers
    layer_types = getattr(text_config, "layer_types", None)
    if layer_types:
        return list(layer_types)[:num_layers]
    if getattr(text_config, "model_type", None) == "gpt_neo":
        # GPT-Neo's `attention_layers`: "local" layers attend a window of `window_size` (`sliding_window_of`).
        kinds = {"global": FULL_ATTENTION, "local": SLIDING_ATTENTION}
        return [kinds.get(t, t) for t in text_config.attention_layers][:num_layers]
    window = getattr(text_config, "sliding_window", None)
    sliding = window is not None and getattr(text_config, "use_sliding_window", True)
    return [SLIDING_ATTENTION if sliding else FULL_ATTENTION] * num_layers


def sliding_window_of(text_config: PretrainedConfig) -> int | None:
    """The window of the config's sliding layers: `sliding_window`, or GPT-Neo's `window_size`."""
    if getattr(text_config, "model_type", None) == "gpt_neo":
        return text_config.window_size
    return getattr(text_config, "sliding_window", None)


def kv_kind_of(layer_type: str) -> str | None:
    """The attention kind whose KV a layer of `layer_type` caches (None: no KV; unknown types are kept
    as they are, for `kv_groups_from_config` to refuse)."""
    if layer_type in STATE_LAYER_TYPES:
        return STATE_LAYER_TYPES[layer_type]
    if layer_type in STATELESS_LAYER_TYPES:
        return None
    if layer_type == INDEXED_ATTENTION:
        return FULL_ATTENTION  # every earlier key is a candidate; the indexer's selection is a mask
    return layer_type


def state_layer_indices(config: PretrainedConfig) -> list[int]:
    """The decoder layers that keep a recurrent state (transformers' state-holding layer types)."""
    return [i for i, t in enumerate(layer_types_of(config.get_text_config())) if t in STATE_LAYER_TYPES]


def kv_layer_indices(config: PretrainedConfig) -> list[int]:
    """The decoder layers that cache K/V (every layer but the state-only and feed-forward-only ones)."""
    return [i for i, t in enumerate(layer_types_of(config.get_text_config())) if kv_kind_of(t) is not None]


def layer_head_shapes(text_config: PretrainedConfig) -> list[tuple[int, int]] | None:
    """(KV heads, head dim) of every decoder layer, read through the config's per-layer accessor
    (`per_layer_config[i]`) when its head shape varies per layer; None when every layer has the global one."""
    per_layer = getattr(text_config, "per_layer_attributes", None) or set()
    if not per_layer & HEAD_SHAPE_ATTRIBUTES:
        return None
    shapes = []
    for layer_config in text_config.per_layer_config[: text_config.num_hidden_layers]:
        num_heads = layer_config.num_attention_heads
        kv_heads = getattr(layer_config, "num_key_value_heads", None) or num_heads
        head_dim = getattr(layer_config, "head_dim", None) or layer_config.hidden_size // num_heads
        shapes.append((int(kv_heads), int(head_dim)))
    return shapes


def kv_groups_from_config(
    config: PretrainedConfig, observed: ObservedLayers | None = None
) -> list[KVGroupSpec]:
    """Full-attention groups first (when present), then the sliding ones, then the chunked ones; with
    per-layer head shapes, one group per (kind, head shape), in layer order. Raises on unknown types.

    Args:
        observed: what the model's forward showed (`ObservedLayers`); None: the config alone."""
    text_config = config.get_text_config()
    raw_types = layer_types_of(text_config)
    layer_types = [kv_kind_of(t) for t in raw_types]
    if INDEXED_ATTENTION in raw_types and latent_shape_of(text_config) is None:
        # Without a latent there is no page row to carry the indexer's keys: refused as an unknown kind.
        layer_types = [INDEXED_ATTENTION if r == INDEXED_ATTENTION else kv_kind_of(r) for r in raw_types]
    unknown = sorted({t for t in layer_types if t is not None} - set(KNOWN_LAYER_TYPES))
    if unknown:
        model_type = getattr(text_config, "model_type", "?")
        raise NotImplementedError(
            f"model_type={model_type!r} has layers of attention type {unknown}; continuous batching supports "
            f"only {list(KNOWN_LAYER_TYPES)} layers"
        )
    window = sliding_window_of(text_config)
    if SLIDING_ATTENTION in layer_types and (not isinstance(window, int) or window < 1):
        raise ValueError(f"the config has sliding_attention layers but sliding_window={window!r}")
    chunk = getattr(text_config, "attention_chunk_size", None)
    if CHUNKED_ATTENTION in layer_types and (not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"the config has chunked_attention layers but attention_chunk_size={chunk!r}")
    latent = latent_shape_of(text_config)
    shapes = (
        list(observed.head_shapes) if observed is not None and observed.head_shapes else None
    ) or layer_head_shapes(text_config)
    if latent is not None:
        # Why one head of the summed width: the latent and the rotary key of a token are one row, the
        # absorbed decode's single KV head (attention/families/latent.py).
        shapes = [(1, sum(latent))] * len(layer_types)
        observed = None
    value_dims = list(observed.value_dims) if observed is not None and observed.value_dims else None
    repeats = list(observed.kv_repeats) if observed is not None and observed.kv_repeats else None

    index_dim = getattr(text_config, "index_head_dim", None) if latent is not None else None

    def key_of(i: int) -> tuple[tuple[int, int] | None, int | None, int, int | None]:
        """What a group's layers share: K's head shape, V's head size (None: K's), the K/V repeat, the
        indexer's key size (DeepSeek sparse attention's layers)."""
        shape = None if shapes is None else shapes[i]
        value = None if value_dims is None or shape is None or value_dims[i] == shape[1] else value_dims[i]
        index = int(index_dim) if index_dim and raw_types[i] == INDEXED_ATTENTION else None
        return shape, value, 1 if repeats is None else repeats[i], index

    groups = []
    for kind in KNOWN_LAYER_TYPES:
        layers = [i for i, t in enumerate(layer_types) if t == kind]
        # Why per shape: a group's pages are one tensor, whose layers share one (KV heads, head dim), V's
        # head size and K/V repeat.
        for shape, value, repeat, index in dict.fromkeys(key_of(i) for i in layers):
            members = tuple(i for i in layers if key_of(i) == (shape, value, repeat, index))
            groups.append(
                KVGroupSpec(
                    kind,
                    members,
                    window if kind == SLIDING_ATTENTION else None,
                    shape,
                    chunk if kind == CHUNKED_ATTENTION else None,
                    latent,
                    value,
                    repeat,
                    index,
                )
            )
    return groups


def layer_to_group(
    groups: list[KVGroupSpec], num_layers: int, kv_layers: list[int] | None = None
) -> list[int]:
    """`result[layer_idx]` = index of the group holding that layer (-1: a layer without KV, which
    `kv_layers`, the layers that cache K/V, leaves out; None: every layer caches K/V)."""
    mapping = [-1] * num_layers
    for g, spec in enumerate(groups):
        for layer in spec.layer_indices:
            mapping[layer] = g
    expected = range(num_layers) if kv_layers is None else kv_layers
    check(all(mapping[i] != -1 for i in expected), f"layers without a KV group: {mapping}")
    return mapping
