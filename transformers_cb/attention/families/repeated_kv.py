"""K/V a layer tiles over its query heads before attending (JetMoE), cached once.

JetMoE's attention repeats its K/V once per routed expert (`key.repeat(1, top_k, 1, 1)`: heads
`[k0, k1, k0, k1]`) and hands the repeated heads to the attention interface, so query head `h` reads KV
head `h // group % kv_heads` of the heads before the repeat (`group` = query heads per repeated head). The
paged kernels map query head `h` to KV head `h // (query heads / KV heads)` (grouped-query attention), so
the glue hands them the heads before the repeat with the query heads sorted by the KV head they read
(`untiled`), and puts the output heads back in the module's order (`retiled`): the cache holds
`top_k` times fewer bytes (the KV group's `kv_repeat`, learned by model_check's probe) and every kernel runs
unchanged. Only the order of the heads moves: the products and sums are the same as over the repeat.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from ...invariants import check


@lru_cache(maxsize=64)
def head_order(query_heads: int, kv_heads: int, repeat: int, device: torch.device) -> torch.Tensor:
    """`[query_heads]` int64: the query heads stably sorted by the KV head (before the repeat) each reads,
    the order grouped-query attention over `kv_heads` reads them in. Kept per device: made once, before a
    CUDA graph captures a step (no host-to-device copy inside a capture)."""
    group = query_heads // (kv_heads * repeat)
    order = sorted(range(query_heads), key=lambda h: h // group % kv_heads)
    return torch.tensor(order, device=device)


def untiled(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_heads: int, repeat: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """query `[1, H, T, D]` and key/value `[1, kv_heads * repeat, T, D]` tiled `repeat` times -> the query
    heads reordered, the K/V heads before the repeat, and the order (for `retiled`)."""
    check(
        key.shape[1] == kv_heads * repeat and value.shape[1] == kv_heads * repeat,
        f"a layer cached with {kv_heads} KV heads repeated {repeat} times passed K/V of "
        f"{key.shape[1]} / {value.shape[1]} heads",
    )
    check(
        query.shape[1] % (kv_heads * repeat) == 0,
        f"{query.shape[1]} query heads for {kv_heads * repeat} repeated KV heads",
    )
    order = head_order(query.shape[1], kv_heads, repeat, query.device)
    return query.index_select(1, order), key[:, :kv_heads], value[:, :kv_heads], order


def retiled(out: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """The attention output `[1, T, H, D]` of reordered query heads, back in the module's head order."""
    return torch.empty_like(out).index_copy_(2, order, out)
