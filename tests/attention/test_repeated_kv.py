"""K/V tiled over the query heads (JetMoE) attended from the heads before the repeat: the query heads sorted
by the KV head they read, the output put back in the module's order, equal to attention over the repeat."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from transformers_cb.attention.families.repeated_kv import retiled, untiled


@pytest.mark.parametrize(("heads", "kv_heads", "repeat"), [(4, 2, 2), (8, 2, 2), (6, 3, 2), (8, 1, 4)])
def test_attention_over_the_heads_before_the_repeat_equals_the_repeat(heads, kv_heads, repeat) -> None:
    torch.manual_seed(0)
    query = torch.randn(1, heads, 5, 8)
    key, value = torch.randn(1, kv_heads, 5, 8), torch.randn(1, kv_heads, 5, 8)
    tiled_key, tiled_value = key.repeat(1, repeat, 1, 1), value.repeat(1, repeat, 1, 1)
    expected = F.scaled_dot_product_attention(query, tiled_key, tiled_value, is_causal=True, enable_gqa=True)
    q, k, v, order = untiled(query, tiled_key, tiled_value, kv_heads, repeat)
    assert torch.equal(k, key) and torch.equal(v, value)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # [1, H, T, D]
    actual = retiled(out.transpose(1, 2), order)  # [1, T, H, D], the layout the glue returns
    torch.testing.assert_close(actual, expected.transpose(1, 2))


def test_kv_of_another_head_count_is_refused() -> None:
    with pytest.raises(Exception, match="repeated 2 times passed K/V of 6"):
        untiled(torch.randn(1, 4, 5, 8), torch.randn(1, 6, 5, 8), torch.randn(1, 6, 5, 8), 2, 2)
