"""Packing a `StepPlan` into the varlen tensors of one forward pass.

Token order inside the step: decodes first, sorted by KV length (longest first)
and split into groups whose padded size stays within `decode_padding_bound(dtype)` of
their real size (float32 KV only: in lower precision only equal lengths share a call); then each
prefill chunk. `PackedStep.sampling_entries` names the scheduled entry of each
sampled row. Slots, gathers and masks are built once per KV layer
group (full attention, sliding window, chunked attention) and shared by that group's layers.

With the native CPU kernel, short prefill chunks (queries x keys at most `native_prefill_max_work(dtype)`)
follow the decodes, and all of those tokens are one native call per layer; longer chunks come
last and keep their own SDPA / eager call, except where the kernel's query tiles take chunks of any length
(`BatchPacker.every_long_chunk_native`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..attention.metadata import (
    AttentionMetadata,
    DecodeGroup,
    GroupMetadata,
    PrefillGroup,
    first_visible_key,
    visible_keys,
)
from ..attention.native.kernel import cpu_has_amx, native_supported, vector_lanes
from ..invariants import present
from ..kv.rope_rule import RopeRule
from ..memory.block_tables import BlockTables
from ..memory.kv_cache import PagedKVCache
from ..requests import Request
from ..scheduler.step_plan import ScheduledRequest, StepPlan
from .call_groups import (
    decode_padding_bound,
    group_decodes,
    native_chunk_max_work,
    native_prefill_max_work,
)
from .media.image_blocks import blocks_in, widened_mask
from .states.state_layers import StateTable

# The native kernel's block tables are at least this wide when the forward is compiled (`_group_metadata`).
MIN_COMPILED_TABLE_COLUMNS = 2


@dataclass
class PackedStep:
    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    logits_indices: torch.Tensor  # [S]: packed positions whose logits are sampled
    sampling_entries: list[ScheduledRequest]  # in logits order, 1 + len(entry.draft) rows each
    metadata: AttentionMetadata
    # Prompt logprobs (only requests that ask for them): packed positions, and per request
    # (request, first prompt index scored, count) in the same order.
    prompt_indices: list[int] = field(default_factory=list)
    prompt_spans: list[tuple[Request, int, int]] = field(default_factory=list)
    # Each request's rows and state slot, for a model with state layers (runner/states/state_layers.py).
    states: StateTable | None = None
    # The entries in packed order (the media's rows follow it: runner/media/media_runner.py).
    ordered: list[ScheduledRequest] = field(default_factory=list)


def state_table(ordered: list[ScheduledRequest], device: torch.device) -> StateTable:
    """The state table of a step packed in `ordered` order: the leading one-token rows of requests that
    have a state run as one batch, every other entry as a span of its own."""
    num_decodes = 0
    while (
        num_decodes < len(ordered) and ordered[num_decodes].num_tokens == 1 and ordered[num_decodes].start > 0
    ):
        num_decodes += 1
    spans = []
    row = num_decodes
    for entry in ordered[num_decodes:]:
        spans.append((row, entry.num_tokens, entry.state_slot, entry.start == 0))
        row += entry.num_tokens
    slots = [entry.state_slot for entry in ordered[:num_decodes]]
    return StateTable(
        decode_slots=torch.tensor(slots, dtype=torch.int64, device=device) if slots else None,
        num_decode_rows=num_decodes,
        spans=spans,
    )


def _prompt_positions(
    entry: ScheduledRequest, q_start: int, indices: list[int], spans: list[tuple[Request, int, int]]
) -> None:
    """Positions of `entry` whose next token is a prompt token not scored yet.

    Position p predicts token p + 1; a recomputed (preempted) request skips what it already has."""
    request = entry.request
    first = max(entry.start + 1, len(request.prompt_logprobs or ()) + 1)
    last = min(entry.end, request.num_prompt_tokens - 1)
    if first > last:
        return
    indices.extend(q_start + target - 1 - entry.start for target in range(first, last + 1))
    spans.append((request, first, last - first + 1))


class BatchPacker:
    """Builds `PackedStep`s; owns the persistent block tables (one set per KV group) of running requests.

    Args:
        max_pages_per_request: block-table width, one for every group or one per group (a sliding
            group's width only needs to cover its window plus one step's chunk).
        initial_pages_per_request: width allocated up front (rows widen on demand).
        native: use the native CPU kernel (True: required, a ValueError when it cannot run here);
            None: whenever it is built and supports the device and the cache dtype.
    """

    def __init__(
        self,
        cache: PagedKVCache,
        max_pages_per_request: int | list[int],
        device: torch.device,
        initial_pages_per_request: int | None = None,
        native: bool | None = None,
    ) -> None:
        self.cache = cache
        dtype = cache.layout.dtype
        self.native = native is not False and native_supported(device, dtype)
        self.decode_padding_bound = decode_padding_bound(dtype)
        self.native_prefill_max_work = native_prefill_max_work(dtype)
        if native and not self.native:
            raise ValueError(f"the native paged-attention kernel cannot run on {device} with {dtype} KV")
        self.page_size = cache.page_size
        self.device = device
        num_groups = len(cache.groups)
        widths = (
            max_pages_per_request
            if isinstance(max_pages_per_request, list)
            else [max_pages_per_request] * num_groups
        )
        self.block_tables = [
            BlockTables(widths[g], device, initial_pages=initial_pages_per_request, group=g)
            for g in range(num_groups)
        ]
        self._page_offsets = torch.arange(self.page_size, device=device)
        # The model has state layers: each step carries its `StateTable` (set by the engine's builder).
        self.state_layers = False
        # A dynamic rotary embedding's rule (kv/rope_rule.py): each step carries its tokens' frequency
        # sets (`AttentionMetadata.rope_groups`, runner/request_rotary.py); set by the engine's builder.
        self.rope_rule: RopeRule | None = None
        # Narrowest block table handed to the native kernel: the runner sets MIN_COMPILED_TABLE_COLUMNS
        # when the torch backends' forward is compiled.
        self.min_table_columns = 1

    def every_chunk_native(self) -> None:
        """Batch-invariant mode (`ContinuousBatchingConfig.batch_invariant`): every token of every step on
        the native kernel, whose reduction over a token's keys is fixed by its own position, so a token's
        attention is the same bits whether its prompt came in one chunk or several and whatever shares the
        step (SDPA's blocked kernel reduces a long chunk's keys in blocks of the chunk's shape). A chunk
        holding a block that attends both ways (Gemma 3's images) still takes its widened mask."""
        if not self.native:
            raise ValueError("batch_invariant=True needs the native paged-attention kernel for this cache")
        self.native_prefill_max_work = sys.maxsize

    def every_long_chunk_native(self, group_size: int) -> None:
        """Prefill chunks up to `call_groups.native_chunk_max_work` (any length with AVX-512) join the native call
        where the kernel's query tiles beat SDPA (`group_size`: query heads per KV head); only ever raised."""
        if self.native:
            bound = native_chunk_max_work(self.cache.layout, group_size, vector_lanes(), cpu_has_amx())
            self.native_prefill_max_work = max(self.native_prefill_max_work, bound)

    def release_request(self, request) -> None:
        """Give `request`'s rows back in every group (the runner, for each request whose pages were freed)."""
        for tables in self.block_tables:
            tables.release(request)

    def take_back(self, request: Request, end_pages: Sequence[int]) -> None:
        """`request` gave pages back from its end (speculation's rejected draft tokens), in every group
        down to its `end_pages[g]`."""
        for tables, end_page in zip(self.block_tables, end_pages, strict=True):
            tables.take_back(request, end_page)

    def pack(self, batch: StepPlan) -> PackedStep:
        decodes = sorted((e for e in batch.entries if e.num_tokens == 1), key=lambda e: -e.end)
        prefills = [e for e in batch.entries if e.num_tokens > 1]
        num_native_rows = 0
        if self.native:
            # A speculating request's few query tokens (1 + draft) join the native call at any KV length.
            # A chunk holding a block that attends both ways needs its widened mask: never the native call.
            short = [
                e
                for e in prefills
                if (e.draft or e.num_tokens * e.end <= self.native_prefill_max_work) and not blocks_in(e)
            ]
            prefills = short + [e for e in prefills if not any(e is s for s in short)]
            num_native_rows = len(decodes) + len(short)
        ordered = decodes + prefills
        input_ids: list[int] = []
        positions: list[int] = []
        cu_seqlens_q = [0]
        sampling: list[ScheduledRequest] = []
        logits_indices: list[int] = []
        prompt_indices: list[int] = []
        prompt_spans: list[tuple[Request, int, int]] = []
        for entry in ordered:
            request, start, end = entry.request, entry.start, entry.end
            input_ids.extend(entry.token_ids)
            positions.extend(range(start, end))
            if request.wants_prompt_logprobs:
                _prompt_positions(entry, cu_seqlens_q[-1], prompt_indices, prompt_spans)
            cu_seqlens_q.append(cu_seqlens_q[-1] + entry.num_tokens)
            if entry.samples:
                sampling.append(entry)
                # A speculating entry's rows: its last known token and each draft token (verification).
                logits_indices.extend(range(cu_seqlens_q[-1] - 1 - len(entry.draft), cu_seqlens_q[-1]))
        position_ids = torch.tensor(positions, dtype=torch.int64, device=self.device)
        q_lens = torch.tensor([e.num_tokens for e in ordered], dtype=torch.int64, device=self.device)
        token_entry = torch.repeat_interleave(torch.arange(len(ordered), device=self.device), q_lens)  # [T]
        max_seqlen_k = max(e.end for e in ordered)
        seq_lens_k = torch.tensor([e.end for e in ordered], dtype=torch.int64, device=self.device)
        native_tokens = cu_seqlens_q[num_native_rows]
        groups = [
            self._group_metadata(
                g, ordered, len(decodes), num_native_rows, position_ids, token_entry, seq_lens_k, max_seqlen_k
            )
            for g in range(len(self.block_tables))
        ]
        metadata = AttentionMetadata(
            cache=self.cache,
            groups=groups,
            cu_seqlens_q=torch.tensor(cu_seqlens_q, dtype=torch.int32, device=self.device),
            seq_lens_k=seq_lens_k.to(torch.int32),
            max_seqlen_q=max(e.num_tokens for e in ordered),
            max_seqlen_k=max_seqlen_k,
            native_tokens=native_tokens,
            token_row=token_entry[:native_tokens] if native_tokens else None,
            token_pos=position_ids[:native_tokens] if native_tokens else None,
            all_native=num_native_rows == len(ordered),
            position_ids=position_ids,
            rope_groups=self._rope_groups(ordered) if self.rope_rule is not None else None,
        )
        return PackedStep(
            input_ids=torch.tensor([input_ids], dtype=torch.int64, device=self.device),
            position_ids=position_ids.unsqueeze(0),
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=self.device),
            sampling_entries=sampling,
            metadata=metadata,
            prompt_indices=prompt_indices,
            prompt_spans=prompt_spans,
            states=state_table(ordered, self.device) if self.state_layers else None,
            ordered=ordered,
        )

    def _rope_groups(self, ordered: list[ScheduledRequest]) -> list[tuple[int, torch.Tensor | None]]:
        """Each frequency set of the step's tokens (`RopeRule.frequency_key` from the request's own prompt
        length and the token's position) with the packed indices of its tokens; one set: no indices."""
        rule = present(self.rope_rule, "rope groups without a rope rule")
        keys: list[int] = []
        for entry in ordered:
            prompt, length = entry.request.num_prompt_tokens, entry.request.num_tokens
            keys.extend(rule.frequency_key(prompt, length, p) for p in range(entry.start, entry.end))
        distinct = sorted(set(keys))
        if len(distinct) == 1:
            return [(distinct[0], None)]
        by_key: dict[int, list[int]] = {k: [] for k in distinct}
        for i, key in enumerate(keys):
            by_key[key].append(i)
        return [(k, torch.tensor(rows, dtype=torch.int64, device=self.device)) for k, rows in by_key.items()]

    def _group_metadata(
        self,
        group: int,
        ordered: list[ScheduledRequest],
        num_decodes: int,
        num_native_rows: int,
        position_ids: torch.Tensor,
        token_entry: torch.Tensor,
        seq_lens_k: torch.Tensor,
        max_seqlen_k: int,
    ) -> GroupMetadata:
        tables = self.block_tables[group]
        spec = self.cache.groups[group]
        window, chunk = spec.sliding_window, spec.attention_chunk_size
        rows = torch.tensor([tables.sync(e.request) for e in ordered], dtype=torch.int64)
        table_rows = tables.table[rows.to(self.device)]  # [N, current width]
        ring, page_size = tables.max_pages_per_request, self.page_size
        # slot = page_id * page_size + offset; logical page p of a row sits in column p % ring.
        columns = torch.div(position_ids, page_size, rounding_mode="floor") % ring
        slot_mapping = table_rows[token_entry, columns] * page_size + position_ids % page_size
        num_pages = -(-max_seqlen_k // page_size)
        if num_pages <= ring:
            block_table = table_rows[:, :num_pages]
        else:
            block_table = table_rows[:, torch.arange(num_pages, device=self.device) % ring]
        if self.native and block_table.shape[1] < self.min_table_columns:
            # Padding columns repeat the row's first page (never read): a compiled forward then never
            # meets a one-column table, which torch.compile would specialise (and recompile) for.
            pad = block_table[:, :1].expand(-1, self.min_table_columns - block_table.shape[1])
            block_table = torch.cat([block_table, pad], dim=1)
        # Rows the native kernel attends need no groups: decodes, then the prefills after them.
        decodes = [] if num_native_rows else ordered[:num_decodes]
        first_row = max(num_decodes, num_native_rows)
        first_token = num_decodes + sum(e.num_tokens for e in ordered[num_decodes:first_row])
        return GroupMetadata(
            sliding_window=window,
            slot_mapping=slot_mapping,
            decode_groups=self._decode_groups(
                decodes, block_table, table_rows, ring, seq_lens_k, window, chunk
            ),
            prefill_groups=self._prefill_groups(
                ordered[first_row:], first_row, first_token, block_table, table_rows, ring, window, chunk
            ),
            # Canonical strides (a one-row slice keeps its parent's): a compiled forward guards on them.
            block_table=block_table.to(torch.int32, memory_format=torch.contiguous_format),
            chunk_size=chunk,
            latent=spec.latent,
        )

    def _slots(self, block_table_rows: torch.Tensor, kv_len: int) -> torch.Tensor:
        """Slots of the first `kv_len` tokens for each row of `block_table_rows` `[B, P]` -> `[B, kv_len]`."""
        slots = block_table_rows[:, :, None] * self.page_size + self._page_offsets  # [B, P, page_size]
        # Contiguous once here, so every layer's gather can flatten it without a copy.
        return slots.reshape(block_table_rows.shape[0], -1)[:, :kv_len].contiguous()

    def _window_slots(self, table_rows: torch.Tensor, ring: int, positions: torch.Tensor) -> torch.Tensor:
        """Slots of logical `positions` `[B, L]` through rows `table_rows` of a ring of `ring` columns."""
        columns = torch.div(positions, self.page_size, rounding_mode="floor") % ring
        return table_rows.gather(1, columns) * self.page_size + positions % self.page_size

    def _decode_groups(
        self,
        decodes: list[ScheduledRequest],
        block_table: torch.Tensor,
        table_rows: torch.Tensor,
        ring: int,
        seq_lens_k: torch.Tensor,
        window: int | None,
        chunk: int | None = None,
    ) -> list[DecodeGroup]:
        """Full attention reads KV [0, end); a sliding group only [end - window, end) (its whole window); a
        chunked group [its chunk's start, end) (`first_visible_key`)."""
        ends = [e.end for e in decodes]
        kv_lens = [end - first_visible_key(end - 1, window, chunk) for end in ends]
        full = window is None and chunk is None
        groups = []
        for start, end in group_decodes(kv_lens, self.decode_padding_bound):
            kv_len = max(kv_lens[start:end])
            if full:
                num_pages = -(-kv_len // self.page_size)
                kv_slots = self._slots(block_table[start:end, :num_pages], kv_len)  # [B, L]
            else:
                first = seq_lens_k[start:end] - torch.tensor(kv_lens[start:end], device=self.device)
                positions = first[:, None] + torch.arange(kv_len, device=self.device)  # [B, L]
                kv_slots = self._window_slots(table_rows[start:end], ring, positions)
            kv_mask = None
            if min(kv_lens[start:end]) != kv_len:
                lengths = torch.tensor(kv_lens[start:end], device=self.device)
                arange = torch.arange(kv_len, device=self.device)
                kv_mask = (arange[None, :] < lengths[:, None]).view(end - start, 1, 1, kv_len)
            groups.append(DecodeGroup(start, end, kv_slots, kv_mask))
        return groups

    def _prefill_groups(
        self,
        prefills: list[ScheduledRequest],
        first_row: int,
        first_token: int,
        block_table: torch.Tensor,
        table_rows: torch.Tensor,
        ring: int,
        window: int | None,
        chunk: int | None = None,
    ) -> list[PrefillGroup]:
        groups, q_start = [], first_token
        for i, entry in enumerate(prefills, start=first_row):
            q_end = q_start + entry.num_tokens
            kv_slots = mask = None
            if window is None and chunk is None and entry.start > 0:
                num_pages = -(-entry.end // self.page_size)
                kv_slots = self._slots(block_table[i : i + 1, :num_pages], entry.end)[0]  # [L]
                mask = torch.ones(entry.num_tokens, entry.end, dtype=torch.bool, device=self.device)
                mask = mask.tril(entry.start).view(1, 1, entry.num_tokens, entry.end)
            elif entry.start > 0 or first_visible_key(entry.end - 1, window, chunk) > 0:
                # Keys from the first position the chunk's first query still sees (sliding or chunked).
                kv_start = first_visible_key(entry.start, window, chunk)
                kv_positions = torch.arange(kv_start, entry.end, device=self.device)
                if entry.start > 0:
                    kv_slots = self._window_slots(table_rows[i : i + 1], ring, kv_positions[None, :])[0]
                else:
                    kv_positions = kv_positions[: entry.num_tokens]  # the chunk's own K/V
                q_positions = torch.arange(entry.start, entry.end, device=self.device)
                mask = visible_keys(q_positions, kv_positions, window, chunk).view(1, 1, entry.num_tokens, -1)
            blocks = blocks_in(entry)
            if blocks:  # tokens of one block attend to each other both ways (Gemma 3's images)
                first_key = 0 if kv_slots is None or mask is None else entry.end - mask.shape[-1]
                mask = widened_mask(mask, entry, first_key, blocks, window, chunk, self.device)
            groups.append(PrefillGroup(q_start, q_end, entry.start, kv_slots, mask))
            q_start = q_end
        return groups
