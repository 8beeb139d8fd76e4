"""KV groups keyed by head shape: layers whose (KV heads, head dim) differ (per_layer_config) get their
own groups, read per layer; models with one head shape keep one group per layer kind."""

from __future__ import annotations

from transformers import AutoConfig

from tests.support.models import build_tiny_model
from transformers_cb.kv.layer_groups import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    KVGroupSpec,
    kv_groups_from_config,
    layer_head_shapes,
)

GEMMA4 = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "hidden_size_per_layer_input": 8,
    "vocab_size_per_layer_input": 64,
    "sliding_window": 8,
}


def gemma4_config(**overrides):
    return AutoConfig.for_model("gemma4_text", **{**GEMMA4, **overrides})


def test_gemma4_layer_kinds_get_their_own_head_shapes() -> None:
    config = gemma4_config(
        num_hidden_layers=4,
        layer_types=[SLIDING_ATTENTION, FULL_ATTENTION] * 2,
        global_head_dim=16,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
    )
    assert layer_head_shapes(config) == [(2, 8), (1, 16), (2, 8), (1, 16)]
    assert kv_groups_from_config(config) == [
        KVGroupSpec(FULL_ATTENTION, (1, 3), None, (1, 16)),
        KVGroupSpec(SLIDING_ATTENTION, (0, 2), 8, (2, 8)),
    ]


def test_layers_of_one_kind_with_different_shapes_are_split() -> None:
    """Two sliding layers of different head dims cannot share one page tensor: two sliding groups."""
    config = gemma4_config(
        num_hidden_layers=3,
        layer_types=[SLIDING_ATTENTION, SLIDING_ATTENTION, FULL_ATTENTION],
        per_layer_config={1: {"head_dim": 4}, 2: {"head_dim": 16}},
    )
    groups = kv_groups_from_config(config)
    assert groups == [
        KVGroupSpec(FULL_ATTENTION, (2,), None, (2, 16)),
        KVGroupSpec(SLIDING_ATTENTION, (0,), 8, (2, 8)),
        KVGroupSpec(SLIDING_ATTENTION, (1,), 8, (2, 4)),
    ]
    assert [g.name for g in groups][1:] == [
        "sliding_attention(window=8)[heads=2, dim=8]",
        "sliding_attention(window=8)[heads=2, dim=4]",
    ]


def test_one_head_shape_keeps_one_group_per_kind_without_a_shape() -> None:
    config = build_tiny_model("gemma3").config
    assert layer_head_shapes(config) is None
    assert all(group.head_shape is None for group in kv_groups_from_config(config))
