"""Per-step attention metadata, built once by `batch.py` and shared by every layer.

Packed layout of one step (decodes first, sorted by KV length, then prefill chunks):

    tokens:  [d0 d1 d2 ... | p0 p0 p0 p0 | p1 p1 ...]
              decode groups  prefill groups (one per request)

A decode group is a contiguous run of single-token queries whose KV lengths are
close, gathered into one padded `[B, L]` slot index so the group is one batched
attention call whose padding stays bounded. Each prefill chunk attends only to
its own request's KV. No query ever attends over another request's KV.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..cache.paged_cache import PagedKVCache


@dataclass(slots=True)
class DecodeGroup:
    q_start: int
    q_end: int
    kv_slots: torch.Tensor  # [B, L] int64, padded with a valid slot
    kv_mask: torch.Tensor | None  # [B, 1, 1, L] bool, True = attend; None when no padding


@dataclass(slots=True)
class PrefillGroup:
    q_start: int
    q_end: int
    past_len: int  # KV tokens of this request already in the cache before this chunk
    kv_slots: torch.Tensor | None  # [past_len + q_len] int64; None when past_len == 0
    mask: (
        torch.Tensor | None
    )  # [1, 1, q_len, past_len + q_len] bool causal (bottom-right); None when past_len == 0


@dataclass
class AttentionMetadata:
    cache: PagedKVCache
    slot_mapping: torch.Tensor  # [T] int64: where each new token's K/V is written
    decode_groups: list[DecodeGroup]
    prefill_groups: list[PrefillGroup]
    # The same step as a varlen batch (flash-attn naming), for the reference kernel and flash backends.
    cu_seqlens_q: torch.Tensor  # [N + 1] int32
    seq_lens_k: torch.Tensor  # [N] int32
    block_table: torch.Tensor  # [N, max_pages] int32
    max_seqlen_q: int
    max_seqlen_k: int
