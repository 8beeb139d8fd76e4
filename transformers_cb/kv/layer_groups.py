"""KV cache layer groups: which layers share a page policy, read from the model config.

Layers are grouped by attention type. Each group has its own page pool and
page policy (pages of the same `page_size`), and a request holds one page list
per group. Full-attention layers keep every token; sliding-window layers only
the last `sliding_window` tokens (see `page_policies.SlidingWindowPolicy`).

Where the type of each layer comes from:
- `config.layer_types` when present (Gemma 2/3, Qwen2, Cohere2, GPT-OSS, ...);
- otherwise `config.sliding_window` (with `use_sliding_window` when the config
  has it) makes every layer sliding: that is Mistral's convention.
Any other layer type (linear attention, chunked attention, state-space blocks)
is refused by `model_support.check_model_supported` before anything is allocated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..invariants import check

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
KNOWN_LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)


@dataclass(frozen=True)
class KVGroupSpec:
    """One KV cache group: its attention type, its layers, and its window (None = full attention)."""

    kind: str
    layer_indices: tuple[int, ...]
    sliding_window: int | None = None

    @property
    def name(self) -> str:
        return self.kind if self.sliding_window is None else f"{self.kind}(window={self.sliding_window})"


def layer_types_of(text_config: Any) -> list[str]:
    """The attention type of every decoder layer, following the model's own conventions."""
    num_layers = text_config.num_hidden_layers
    layer_types = getattr(text_config, "layer_types", None)
    if layer_types:
        return list(layer_types)[:num_layers]
    window = getattr(text_config, "sliding_window", None)
    sliding = window is not None and getattr(text_config, "use_sliding_window", True)
    return [SLIDING_ATTENTION if sliding else FULL_ATTENTION] * num_layers


def kv_groups_from_config(config: Any) -> list[KVGroupSpec]:
    """Full-attention group first (when present), then the sliding group. Raises on unknown types."""
    text_config = config.get_text_config()
    layer_types = layer_types_of(text_config)
    unknown = sorted(set(layer_types) - set(KNOWN_LAYER_TYPES))
    if unknown:
        model_type = getattr(text_config, "model_type", "?")
        raise NotImplementedError(
            f"model_type={model_type!r} has layers of attention type {unknown}; continuous batching supports "
            f"only {list(KNOWN_LAYER_TYPES)} layers"
        )
    window = getattr(text_config, "sliding_window", None)
    if SLIDING_ATTENTION in layer_types and (not isinstance(window, int) or window < 1):
        raise ValueError(f"the config has sliding_attention layers but sliding_window={window!r}")
    groups = []
    for kind in KNOWN_LAYER_TYPES:
        layers = tuple(i for i, t in enumerate(layer_types) if t == kind)
        if layers:
            groups.append(KVGroupSpec(kind, layers, window if kind == SLIDING_ATTENTION else None))
    return groups


def layer_to_group(groups: list[KVGroupSpec], num_layers: int) -> list[int]:
    """`result[layer_idx]` = index of the group holding that layer."""
    mapping = [-1] * num_layers
    for g, spec in enumerate(groups):
        for layer in spec.layer_indices:
            mapping[layer] = g
    check(-1 not in mapping, f"layers without a KV group: {mapping}")
    return mapping
