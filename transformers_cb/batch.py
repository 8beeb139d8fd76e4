"""Packing a `ScheduledBatch` into the varlen tensors of one forward pass.

Token order inside the step: decodes first, sorted by KV length (longest first)
and split into groups whose padded size stays within `DECODE_PADDING_BOUND` of
their real size; then each prefill chunk. `entry_order` maps back to the
scheduler's entry order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention.metadata import AttentionMetadata, DecodeGroup, PrefillGroup
from .cache.block_table import BlockTables
from .cache.paged_cache import PagedKVCache
from .scheduler import ScheduledBatch, ScheduledRequest

# A decode group may do at most this much more attention work than its real KV lengths need.
DECODE_PADDING_BOUND = 1.25


@dataclass
class PackedStep:
    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    logits_indices: torch.Tensor  # [S]: packed positions whose logits are sampled
    sampling_entries: list[ScheduledRequest]  # the S entries, in logits order
    metadata: AttentionMetadata


def group_decodes(kv_lens: list[int], bound: float = DECODE_PADDING_BOUND) -> list[tuple[int, int]]:
    """Split descending `kv_lens` into [start, end) runs with `len * max <= bound * sum`."""
    groups: list[tuple[int, int]] = []
    start, total = 0, 0
    for i, length in enumerate(kv_lens):
        if i > start and (i - start + 1) * kv_lens[start] > bound * (total + length):
            groups.append((start, i))
            start, total = i, 0
        total += length
    if start < len(kv_lens):
        groups.append((start, len(kv_lens)))
    return groups


class BatchPacker:
    """Builds `PackedStep`s; owns the persistent block tables of running requests."""

    def __init__(
        self,
        cache: PagedKVCache,
        max_pages_per_request: int,
        device: torch.device,
        initial_pages_per_request: int | None = None,
    ) -> None:
        self.cache = cache
        self.page_size = cache.page_size
        self.device = device
        self.block_tables = BlockTables(
            max_pages_per_request, device, initial_pages=initial_pages_per_request
        )
        self._page_offsets = torch.arange(self.page_size, device=device)

    def pack(self, batch: ScheduledBatch) -> PackedStep:
        decodes = sorted((e for e in batch.entries if e.num_tokens == 1), key=lambda e: -e.end)
        prefills = [e for e in batch.entries if e.num_tokens > 1]
        ordered = decodes + prefills
        page_size = self.page_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu_seqlens_q = [0]
        sampling, logits_indices = [], []
        for entry in ordered:
            request, start, end = entry.request, entry.start, entry.end
            input_ids.extend(request.all_token_ids[start:end])
            positions.extend(range(start, end))
            # slot = page_id * page_size + offset, one page segment at a time.
            position = start
            while position < end:
                page_index, offset = divmod(position, page_size)
                segment_end = min(end, (page_index + 1) * page_size)
                first_slot = request.page_ids[page_index] * page_size + offset
                slots.extend(range(first_slot, first_slot + segment_end - position))
                position = segment_end
            cu_seqlens_q.append(cu_seqlens_q[-1] + entry.num_tokens)
            if entry.samples:
                sampling.append(entry)
                logits_indices.append(cu_seqlens_q[-1] - 1)
        rows = torch.tensor([self.block_tables.sync(e.request) for e in ordered], dtype=torch.int64)
        max_seqlen_k = max(e.end for e in ordered)
        block_table = self.block_tables.table[rows.to(self.device), : -(-max_seqlen_k // page_size)]  # [N, P]
        seq_lens_k = torch.tensor([e.end for e in ordered], dtype=torch.int64, device=self.device)
        metadata = AttentionMetadata(
            cache=self.cache,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),
            decode_groups=self._decode_groups(decodes, block_table, seq_lens_k),
            prefill_groups=self._prefill_groups(prefills, len(decodes), block_table),
            cu_seqlens_q=torch.tensor(cu_seqlens_q, dtype=torch.int32, device=self.device),
            seq_lens_k=seq_lens_k.to(torch.int32),
            block_table=block_table.to(torch.int32),
            max_seqlen_q=max(e.num_tokens for e in ordered),
            max_seqlen_k=max_seqlen_k,
        )
        return PackedStep(
            input_ids=torch.tensor([input_ids], dtype=torch.int64, device=self.device),
            position_ids=torch.tensor([positions], dtype=torch.int64, device=self.device),
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=self.device),
            sampling_entries=sampling,
            metadata=metadata,
        )

    def _slots(self, block_table_rows: torch.Tensor, kv_len: int) -> torch.Tensor:
        """Slots of the first `kv_len` tokens for each row of `block_table_rows` `[B, P]` -> `[B, kv_len]`."""
        slots = block_table_rows[:, :, None] * self.page_size + self._page_offsets  # [B, P, page_size]
        # Contiguous once here, so every layer's gather can flatten it without a copy.
        return slots.reshape(block_table_rows.shape[0], -1)[:, :kv_len].contiguous()

    def _decode_groups(
        self, decodes: list[ScheduledRequest], block_table: torch.Tensor, seq_lens_k: torch.Tensor
    ) -> list[DecodeGroup]:
        groups = []
        for start, end in group_decodes([e.end for e in decodes]):
            kv_len = decodes[start].end
            num_pages = -(-kv_len // self.page_size)
            kv_slots = self._slots(block_table[start:end, :num_pages], kv_len)  # [B, L]
            kv_mask = None
            if decodes[end - 1].end != kv_len:
                arange = torch.arange(kv_len, device=self.device)
                kv_mask = (arange[None, :] < seq_lens_k[start:end, None]).view(end - start, 1, 1, kv_len)
            groups.append(DecodeGroup(start, end, kv_slots, kv_mask))
        return groups

    def _prefill_groups(
        self, prefills: list[ScheduledRequest], first_row: int, block_table: torch.Tensor
    ) -> list[PrefillGroup]:
        groups, q_start = [], first_row
        for i, entry in enumerate(prefills, start=first_row):
            q_end = q_start + entry.num_tokens
            kv_slots = mask = None
            if entry.start > 0:
                num_pages = -(-entry.end // self.page_size)
                kv_slots = self._slots(block_table[i : i + 1, :num_pages], entry.end)[0]  # [L]
                mask = torch.ones(entry.num_tokens, entry.end, dtype=torch.bool, device=self.device)
                mask = mask.tril(entry.start).view(1, 1, entry.num_tokens, entry.end)
            groups.append(PrefillGroup(q_start, q_end, entry.start, kv_slots, mask))
            q_start = q_end
        return groups
