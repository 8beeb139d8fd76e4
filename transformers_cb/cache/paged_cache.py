"""`PagedKVCache`: the KV tensors, one pair per layer, addressed by slot.

A slot is one token position of one page: `slot = page_id * page_size + offset`.
Each layer stores keys and values as `[num_pages * page_size, num_kv_heads, head_dim]`
so that gathering a sequence's KV is one `index_select` over slots.
"""

from __future__ import annotations

import torch

from .pool import PagePool


class PagedKVCache:
    """KV storage for `num_layers` layers sharing one page pool (full attention)."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.pool = PagePool(num_pages)
        num_slots = num_pages * page_size
        # Zero-filled so that padded gathers never read NaN/inf garbage. [num_slots, num_kv_heads, head_dim]
        self.keys = [
            torch.zeros(num_slots, num_kv_heads, head_dim, dtype=dtype, device=device)
            for _ in range(num_layers)
        ]
        self.values = [torch.zeros_like(k) for k in self.keys]

    @property
    def num_pages(self) -> int:
        return self.pool.num_pages

    def write(
        self, layer_idx: int, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> None:
        """Store `key`/`value` `[num_tokens, num_kv_heads, head_dim]` at `slot_mapping` `[num_tokens]`."""
        self.keys[layer_idx].index_copy_(0, slot_mapping, key.to(self.keys[layer_idx].dtype))
        self.values[layer_idx].index_copy_(0, slot_mapping, value.to(self.values[layer_idx].dtype))

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[layer_idx], self.values[layer_idx]

    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() * 2 for k in self.keys)
