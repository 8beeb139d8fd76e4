"""Latent groups (multi-latent attention) in kv/ and memory/: one group whose pages hold a latent row of
kv_lora_rank + qk_rope_head_dim values per token and layer, with no V stream: its spec, sizing, tensors,
page bytes, page copies (forks) and the host tier's mirror all see the latent size, never decompressed K/V."""

from __future__ import annotations

import torch
from transformers import AutoConfig

from transformers_cb.kv.layer_groups import FULL_ATTENTION, KVGroupSpec, kv_groups_from_config
from transformers_cb.memory.host_cache import HostKVCache
from transformers_cb.memory.kv_cache import PagedKVCache
from transformers_cb.memory.sizing import ModelShape

RANK, ROPE, LAYERS = 24, 8, 3


def deepseek_config(**overrides):
    return AutoConfig.for_model(
        "deepseek_v3",
        hidden_size=32,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=RANK,
        qk_rope_head_dim=ROPE,
        qk_nope_head_dim=16,
        v_head_dim=16,
        **overrides,
    )


def latent_group() -> KVGroupSpec:
    return KVGroupSpec(FULL_ATTENTION, tuple(range(LAYERS)), head_shape=(1, RANK + ROPE), latent=(RANK, ROPE))


def test_a_multi_latent_config_has_one_latent_group() -> None:
    (group,) = kv_groups_from_config(deepseek_config())
    assert group == latent_group()
    assert group.kv_streams == 1 and group.name == f"full_attention[latent={RANK}+{ROPE}]"


def test_sizing_counts_the_latent_once_per_layer() -> None:
    shape = ModelShape.from_config(deepseek_config())
    assert shape.latent == (RANK, ROPE)
    assert shape.layer_head_shape(0) == (1, RANK + ROPE)
    assert shape.kv_bytes_per_token(4) == LAYERS * (RANK + ROPE) * 4  # not 2 x heads x (nope + rope, v)


def test_the_group_tensor_holds_one_stream_and_its_values_are_its_keys() -> None:
    cache = PagedKVCache(LAYERS, 5, 4, 1, RANK + ROPE, torch.float32, torch.device("cpu"), [latent_group()])
    (tensor,) = cache.group_tensors
    assert tensor.shape == (1, LAYERS, 5, 4, 1, RANK + ROPE)
    assert cache.layout.group_page_bytes(0) == LAYERS * 4 * (RANK + ROPE) * 4
    assert cache.layout.bytes_per_token() == LAYERS * (RANK + ROPE) * 4
    assert cache.nbytes() == cache.layout.nbytes() == tensor.numel() * 4
    keys, values = cache.layer(1)
    assert keys.data_ptr() == values.data_ptr() and keys.shape == (20, 1, RANK + ROPE)


def test_page_copies_and_the_host_tier_follow_the_latent_layout() -> None:
    cache = PagedKVCache(LAYERS, 5, 4, 1, RANK + ROPE, torch.float32, torch.device("cpu"), [latent_group()])
    torch.manual_seed(0)
    cache.group_tensors[0].copy_(torch.randn(cache.group_tensors[0].shape))
    cache.copy_pages([(0, 1, 3)])
    torch.testing.assert_close(cache.group_tensors[0][:, :, 3], cache.group_tensors[0][:, :, 1])
    host = HostKVCache(cache, 2)
    assert host.tensors[0].shape == (1, LAYERS, 2, 4, 1, RANK + ROPE)
