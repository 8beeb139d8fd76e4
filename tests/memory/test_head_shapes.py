"""Per-group head shapes in memory/: sizing reads each layer's shape (never the ambiguous global one),
and each KV group's tensors, page bytes and layer views have that group's (KV heads, head dim)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from transformers_cb.kv.layer_groups import FULL_ATTENTION, SLIDING_ATTENTION, KVGroupSpec
from transformers_cb.memory.host_cache import HostKVCache
from transformers_cb.memory.kv_cache import PagedKVCache
from transformers_cb.memory.sizing import ModelShape

GROUPS = [
    KVGroupSpec(FULL_ATTENTION, (1, 3), None, (1, 16)),
    KVGroupSpec(SLIDING_ATTENTION, (0, 2), 8, (2, 8)),
]


def gemma4_config():
    return AutoConfig.for_model(
        "gemma4_text",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        global_head_dim=16,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=64,
        sliding_window=8,
        layer_types=[SLIDING_ATTENTION, FULL_ATTENTION] * 2,
    )


def test_model_shape_reads_head_shapes_per_layer() -> None:
    config = gemma4_config()
    with pytest.raises(RuntimeError, match="per-layer attribute"):
        _ = config.head_dim  # transformers' AmbiguousGlobalPerLayerAttributeError
    shape = ModelShape.from_config(config)
    assert shape.layer_head_shapes == ((2, 8), (1, 16), (2, 8), (1, 16))
    assert [shape.layer_head_shape(i) for i in range(4)] == list(shape.layer_head_shapes)
    # K and V of each layer at its own shape: 2 x (16 + 16 + 16 + 16) elements of 4 bytes.
    assert shape.kv_bytes_per_token(4) == 2 * (2 * 8 + 1 * 16) * 2 * 4


def test_uniform_shape_has_no_per_layer_shapes() -> None:
    shape = ModelShape(2, 2, 16, 64, 128, 300, 512)
    assert shape.layer_head_shape(1) == (2, 16)
    assert shape.kv_bytes_per_token(2) == 2 * 2 * 2 * 16 * 2


def test_each_group_tensor_has_its_groups_head_shape() -> None:
    cache = PagedKVCache(4, [3, 5], 4, 99, 99, torch.float32, torch.device("cpu"), GROUPS)
    assert cache.group_tensors[0].shape == (2, 2, 3, 4, 1, 16)
    assert cache.group_tensors[1].shape == (2, 2, 5, 4, 2, 8)
    assert cache.layer(1)[0].shape == (12, 1, 16)
    assert cache.layer(2)[1].shape == (20, 2, 8)
    layout = cache.layout
    assert layout.group_page_bytes(0) == 2 * 2 * 4 * 1 * 16 * 4
    assert layout.group_page_bytes(1) == 2 * 2 * 4 * 2 * 8 * 4
    assert layout.nbytes() == cache.nbytes()
    # A write lands in the layer's own group at its own shape.
    key = torch.randn(2, 1, 16)
    cache.write(3, torch.tensor([0, 5]), key, key + 1)
    assert torch.equal(cache.keys[3][torch.tensor([0, 5])], key)
    assert torch.equal(cache.group_tensors[0][1, 1].reshape(-1, 1, 16)[5], key[1] + 1)


def test_host_tier_mirrors_each_groups_shape() -> None:
    cache = PagedKVCache(4, [3, 5], 4, 99, 99, torch.float32, torch.device("cpu"), GROUPS)
    host = HostKVCache(cache, 2)
    assert [t.shape for t in host.tensors] == [(2, 2, 2, 4, 1, 16), (2, 2, 2, 4, 2, 8)]


# MiMo-V2-Flash's shape: K heads 8 wide, V heads 6 wide (the real model: 192 and 128), one row of both.
VALUE_GROUPS = [
    KVGroupSpec(FULL_ATTENTION, (0,), None, (2, 8), value_dim=6),
    KVGroupSpec(SLIDING_ATTENTION, (1,), 8, (4, 8), value_dim=6),
]


def test_a_value_head_size_other_than_the_keys_is_stored_at_its_own_size() -> None:
    cache = PagedKVCache(2, [3, 5], 4, 99, 99, torch.float32, torch.device("cpu"), VALUE_GROUPS)
    assert cache.group_tensors[0].shape == (1, 1, 3, 4, 2, 14)
    assert cache.group_tensors[1].shape == (1, 1, 5, 4, 4, 14)
    keys, values = cache.layer(1)
    assert keys.shape == (20, 4, 8) and values.shape == (20, 4, 6)
    assert cache.layout.group_page_bytes(0) == 4 * 2 * (8 + 6) * 4  # nothing padded to K's size
    assert cache.layout.bytes_per_token() == (2 + 4) * (8 + 6) * 4
    assert cache.nbytes() == cache.layout.nbytes()
    key, value = torch.randn(2, 4, 8), torch.randn(2, 4, 6)
    cache.write(1, torch.tensor([0, 5]), key, value)
    row = cache.group_tensors[1][0, 0].reshape(-1, 4, 14)[5]
    assert torch.equal(row[:, :8], key[1]) and torch.equal(row[:, 8:], value[1])
    cache.copy_pages([(1, 1, 3)])  # slot 5 is page 1's second slot
    assert torch.equal(cache.keys[1][13], key[1]) and torch.equal(cache.values[1][13], value[1])


def test_a_value_head_size_swaps_with_its_rows() -> None:
    cache = PagedKVCache(2, [3, 5], 4, 99, 99, torch.float32, torch.device("cpu"), VALUE_GROUPS)
    host = HostKVCache(cache, 2)
    assert [t.shape for t in host.tensors] == [(1, 1, 2, 4, 2, 14), (1, 1, 2, 4, 4, 14)]
    assert host.nbytes() == 2 * cache.layout.page_bytes()


def test_sizing_counts_each_layers_value_head_size() -> None:
    shape = ModelShape(2, 2, 8, 64, 128, 300, 512, ((2, 8), (4, 8)), layer_value_dims=(6, 6))
    assert shape.kv_bytes_per_token(4) == (2 + 4) * (8 + 6) * 4
    assert shape.layer_value_dim(1) == 6
