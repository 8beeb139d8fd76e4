"""Per-step attention metadata, built once by `runner/packing.py` and shared by every layer.

Packed layout of one step (decodes first, sorted by KV length, then prefill chunks):

    tokens:  [d0 d1 d2 ... | p0 p0 p0 p0 | p1 p1 ...]
              decode groups  prefill groups (one per request)

With the native CPU kernel (`native/kernel.py`), the decodes and the short prefill chunks come first
and form one run of `native_tokens` tokens that the kernel attends in one call per layer,
straight from the pages (`token_row`, `token_pos`, the group's `block_table`); decode groups
are then empty and prefill groups cover only the long chunks after that run.

A decode group is a contiguous run of single-token queries whose KV lengths are
close, gathered into one padded `[B, L]` slot index so the group is one batched
attention call whose padding stays bounded. Each prefill chunk attends only to
its own request's KV. No query ever attends over another request's KV.

Each KV layer group (full attention, sliding window, chunked attention) has its own
pages, so the slots, groups and masks above exist once per KV group (`GroupMetadata`);
a sliding group's gathers cover only the window, and its masks apply it; a chunked
group's cover only the current attention chunk (`first_visible_key`).
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ..kv.layer_groups import KVGroupSpec
    from ..memory.kv_cache import PagedKVCache

# The metadata of the step whose forward is running in this thread (None outside one), set by the runner
# (`attention.paged.step_metadata`): the paged forward reads it where a layer dropped the kwargs, and a
# multi-latent module hands its latent through only inside such a forward (attention/families/latent.py). `Any`:
# the support check's probe sets its own record here.
STEP_METADATA: contextvars.ContextVar[Any] = contextvars.ContextVar("cb_step_metadata", default=None)


def first_visible_key(position: int, window: int | None, chunk: int | None) -> int:
    """The first key a query at `position` attends (it attends every key from there up to itself): the
    window's first, `(position - window, position]` (transformers' `sliding_window_overlay`), or its
    attention chunk's first, `position // chunk * chunk` (`chunked_overlay`), or 0 (full attention)."""
    if window is not None:
        return max(0, position - window + 1)
    if chunk is not None:
        return position // chunk * chunk
    return 0


def visible_keys(
    q_positions: torch.Tensor, kv_positions: torch.Tensor, window: int | None, chunk: int | None
) -> torch.Tensor:
    """`[Q, K]` bool: query at `q_positions[i]` attends the key at `kv_positions[j]` (causal, and the
    window or chunk of `first_visible_key`)."""
    q, k = q_positions[:, None], kv_positions[None, :]
    allowed = k <= q
    if window is not None:
        allowed &= k > q - window
    elif chunk is not None:
        allowed &= k >= torch.div(q, chunk, rounding_mode="floor") * chunk
    return allowed


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
    kv_slots: torch.Tensor | None  # [kv_len] int64 (window start .. chunk end); None: the chunk's own K/V
    # [1, 1, q_len, kv_len] bool, causal (bottom-right) and windowed; None: plain causal (first chunk
    # within the window).
    mask: torch.Tensor | None


@dataclass
class GroupMetadata:
    """The step as seen by the layers of one KV group (its own pages, slots and window)."""

    sliding_window: int | None  # None: full attention
    slot_mapping: torch.Tensor  # [T] int64: where each new token's K/V is written in this group
    decode_groups: list[DecodeGroup]
    prefill_groups: list[PrefillGroup]
    # Varlen view of this group (flash-attn naming): logical page p of row i is block_table[i, p].
    # A sliding group has dropped the pages before its window; their entries are stale (never read).
    block_table: torch.Tensor  # [N, max_pages] int32
    # A chunked group's attention chunk (a query at q attends keys [q // C * C, q]); None: not chunked.
    chunk_size: int | None = None
    # A latent group's (kv_lora_rank, qk_rope_head_dim): its layers attend through attention/families/latent.py.
    latent: tuple[int, int] | None = None

    @property
    def kernel_window(self) -> int:
        """The native kernel's `window` argument: the window, or minus the attention chunk (a negative
        window is a chunk: `first_key` in attention/native/native_source.py), or 0 (full attention)."""
        if self.sliding_window is not None:
            return self.sliding_window
        return -self.chunk_size if self.chunk_size is not None else 0


@dataclass(slots=True)
class DecodeFastPath:
    """A decode-only step as `flash_attn_with_kvcache` reads it (flash backends on CUDA, full attention).

    Row i's new token goes to position `cache_seqlens[i]`; its pages are `block_table[i]`, a fixed
    `max_blocks_per_request` columns wide (unused columns repeat a valid page: never read)."""

    block_table: torch.Tensor  # [B, max_blocks_per_request] int32
    cache_seqlens: torch.Tensor  # [B] int32: KV tokens before this step's token


@dataclass
class AttentionMetadata:
    cache: PagedKVCache
    groups: list[GroupMetadata]  # one per KV group, indexed by `cache.layer_group[layer_idx]`
    # The same step as a varlen batch (flash-attn naming), for the reference kernel and flash backends.
    cu_seqlens_q: torch.Tensor  # [N + 1] int32
    seq_lens_k: torch.Tensor  # [N] int32
    max_seqlen_q: int
    max_seqlen_k: int
    # The leading tokens the native kernel attends (0: none): each token's block-table row and position.
    native_tokens: int = 0
    token_row: torch.Tensor | None = None  # [native_tokens] int64
    token_pos: torch.Tensor | None = None  # [native_tokens] int64
    # Every token of the step is the native kernel's (no decode or prefill groups): each layer's attention
    # is then one custom op that a compiled forward keeps in its graph (paged.py).
    all_native: bool = False
    # Each token's position in its sequence `[T]` int64 (attention/families/temperature.py reads it).
    position_ids: torch.Tensor | None = None
    # A dynamic rotary embedding's frequency sets (kv/rope_rule.py, `RopeRule.frequency_key`): each
    # key of the step with the tokens that take it (None: every token of the step); None: not such a model.
    rope_groups: list[tuple[int, torch.Tensor | None]] | None = None
    # Filled by the runner for flash backends only (see attention/backends/flash.py).
    cu_seqlens_k: torch.Tensor | None = None  # [N + 1] int32
    decode_fast_path: DecodeFastPath | None = None

    def group_of(self, layer_idx: int) -> GroupMetadata:
        return self.groups[self.cache.layer_group[layer_idx]]

    def kv_group_of(self, layer_idx: int) -> KVGroupSpec:
        """The KV group (its spec) whose pages hold layer `layer_idx`."""
        return self.cache.groups[self.cache.layer_group[layer_idx]]
