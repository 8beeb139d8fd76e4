"""The torch path of a paged step: `mixed_paged_attention`, which follows the step's groups (the native
kernel's leading tokens, then the decode and prefill groups through `attend`), and the native kernel's tokens
through `attend` where the kernel cannot take them (an ALiBi form it does not add, row by row; a layer whose V
head size is not K's, as one padded batch).

An int8 cache (memory/kv_quant.py) is dequantized as it is gathered, into the query's dtype (`_gather_kv`);
a first prompt chunk attends its own K/V as the pages give them back (`round_trip`), as every other token does.

Apart from attention/paged.py's glue because its control flow follows each step's layout: it is the graph
break of a compiled forward by design, where the glue's all-native step is one opaque op.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch

from ..invariants import check, present
from ..memory.kv_quant import dequantize, round_trip
from .families.alibi import RELATIVE, AlibiForm
from .metadata import AttentionMetadata, GroupMetadata, first_visible_key
from .native.kernel import native_paged_attention, write_pages

# attend(query [B, H, Q, D], key [B, Hkv, L, D], value [B, Hkv, L, D], mask [B, 1, Q, L] bool | None,
#        is_causal, scale, softcap: float | None, sinks: [H] | None, slopes: [H] | None) -> [B, H, Q, D]
Attend = Callable[..., torch.Tensor]


def gather_slots(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """`cache[slots]` as `[*slots.shape, Hkv, D]` through one index_select."""
    return cache.index_select(0, slots.reshape(-1)).view(*slots.shape, *cache.shape[1:])


def _gather_kv(
    caches: tuple[torch.Tensor, torch.Tensor],
    scales: tuple[torch.Tensor, torch.Tensor] | None,
    slots: torch.Tensor,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V at `slots` `[...]` as `[..., Hkv, D]`: the cache's rows, or an int8 cache's rows dequantized
    with their scales into `dtype` (the query's)."""
    if scales is None:
        return gather_slots(caches[0], slots), gather_slots(caches[1], slots)
    flat = slots.reshape(-1)
    gathered = []
    for cache, scale in zip(caches, scales, strict=True):
        rows = dequantize(cache.index_select(0, flat), scale.index_select(0, flat), dtype)
        gathered.append(rows.view(*slots.shape, *cache.shape[1:]))
    return gathered[0], gathered[1]


@torch.compiler.disable
def mixed_paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer_idx: int,
    metadata: AttentionMetadata,
    scale: float,
    attend: Attend,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    slopes: torch.Tensor | None = None,
    alibi_form: AlibiForm = RELATIVE,
) -> torch.Tensor:
    """`paged_attention` of any step: the native kernel's leading tokens, then the decode and prefill groups
    through `attend`. Its control flow follows each step's layout (it would recompile every step), so it is
    a graph break of a compiled forward by design."""
    group_metadata = metadata.group_of(layer_idx)
    q = query[0].transpose(0, 1)  # [T, H, D]
    new_keys = key[0].transpose(0, 1)  # [T, Hkv, D]
    new_values = value[0].transpose(0, 1)
    key_cache, value_cache = metadata.cache.layer(layer_idx)
    scales = metadata.cache.layer_scales(layer_idx)
    write_pages(key_cache, value_cache, group_metadata.slot_mapping, new_keys, new_values, scales)
    if scales is not None:
        # Native tokens read the int8 pages and their scales in the kernel; a first chunk attends its own
        # K/V as the pages hold them (what it would read back from them).
        new_keys, new_values = round_trip(new_keys), round_trip(new_values)
    out = q.new_empty(*q.shape[:2], new_values.shape[-1])  # [T, H, D_v], contiguous
    if metadata.native_tokens and slopes is not None and not alibi_form.native:
        _attend_native_rows(
            q,
            (key_cache, value_cache),
            scales,
            layer_idx,
            metadata,
            scale,
            attend,
            softcap,
            sinks,
            slopes,
            alibi_form,
            out,
        )
    elif metadata.native_tokens and not value_cache.is_contiguous():
        # K and V side by side in one row (V's head size is not K's), which the native kernel does not read.
        check(slopes is None, "ALiBi slopes on a layer whose V head size is not K's: no family has both")
        n = metadata.native_tokens
        out[:n] = _native_tokens_by_torch(
            q[:n], (key_cache, value_cache), scales, metadata, group_metadata, attend, scale, softcap, sinks
        )
    elif metadata.native_tokens:
        n = metadata.native_tokens
        native_paged_attention(
            q[:n],
            key_cache,
            value_cache,
            cast(torch.Tensor, metadata.token_row),  # set whenever there are native tokens
            cast(torch.Tensor, metadata.token_pos),
            group_metadata.block_table,
            metadata.cache.page_size,
            scale,
            group_metadata.kernel_window,
            softcap,
            sinks,
            out[:n],
            slopes,
            scales,
        )
    for group in group_metadata.decode_groups:
        q_group = q[group.q_start : group.q_end].unsqueeze(2)  # [B, H, 1, D]
        k_group, v_group = _gather_kv((key_cache, value_cache), scales, group.kv_slots, q.dtype)
        k_group, v_group = k_group.transpose(1, 2), v_group.transpose(1, 2)  # [B, Hkv, L, D]
        o = attend(
            q_group, k_group, v_group, group.kv_mask, False, scale, softcap, sinks, slopes, alibi_form
        )  # [B, H, 1, D]
        out[group.q_start : group.q_end] = o.squeeze(2)
    for chunk in group_metadata.prefill_groups:
        rows = slice(chunk.q_start, chunk.q_end)
        q_group = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, Q, D]
        if chunk.kv_slots is None:
            # First chunk of a sequence: its whole KV is this chunk (causal, or windowed by `mask`).
            k_group = new_keys[rows].transpose(0, 1).unsqueeze(0)  # [1, Hkv, Q, D]
            v_group = new_values[rows].transpose(0, 1).unsqueeze(0)
            is_causal = chunk.q_end - chunk.q_start > 1
            o = attend(
                q_group, k_group, v_group, chunk.mask, is_causal, scale, softcap, sinks, slopes, alibi_form
            )
        else:
            k_rows, v_rows = _gather_kv((key_cache, value_cache), scales, chunk.kv_slots, q.dtype)
            k_group = k_rows.transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
            v_group = v_rows.transpose(0, 1).unsqueeze(0)
            o = attend(
                q_group, k_group, v_group, chunk.mask, False, scale, softcap, sinks, slopes, alibi_form
            )
        out[rows] = o[0].transpose(0, 1)
    return out.unsqueeze(0)


def _attend_native_rows(
    q: torch.Tensor,
    caches: tuple[torch.Tensor, torch.Tensor],
    scales: tuple[torch.Tensor, torch.Tensor] | None,
    layer_idx: int,
    metadata: AttentionMetadata,
    scale: float,
    attend: Attend,
    softcap: float | None,
    sinks: torch.Tensor | None,
    slopes: torch.Tensor,
    alibi_form: AlibiForm,
    out: torch.Tensor,
) -> None:
    """The step's leading tokens, planned for the native kernel, through `attend` one row at a time: the
    native kernel adds only the relative ALiBi form, and the packing plans no groups for its rows."""
    group_metadata = metadata.group_of(layer_idx)
    if group_metadata.sliding_window is not None or group_metadata.chunk_size is not None:
        raise NotImplementedError(
            f"layer {layer_idx}: an ALiBi form the native kernel does not add, on a windowed layer"
        )
    n, page_size = metadata.native_tokens, metadata.cache.page_size
    rows, counts = torch.unique_consecutive(cast(torch.Tensor, metadata.token_row), return_counts=True)
    token_pos = cast(torch.Tensor, metadata.token_pos)
    start = 0
    for row, count in zip(rows.tolist(), counts.tolist(), strict=True):
        end = start + count
        kv_len = int(token_pos[end - 1]) + 1  # a row's tokens are its last `count` positions
        positions = torch.arange(kv_len, device=q.device)
        pages = group_metadata.block_table[row, positions // page_size].long()
        slots = pages * page_size + positions % page_size
        k_rows, v_rows = _gather_kv(caches, scales, slots, q.dtype)
        k_row = k_rows.transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
        v_row = v_rows.transpose(0, 1).unsqueeze(0)
        mask = torch.ones(count, kv_len, dtype=torch.bool, device=q.device).tril(kv_len - count)
        q_row = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, Q, D]
        o = attend(
            q_row,
            k_row,
            v_row,
            mask.view(1, 1, count, kv_len),
            False,
            scale,
            softcap,
            sinks,
            slopes,
            alibi_form,
        )
        out[start:end] = o[0].transpose(0, 1)
        start = end
    check(start == n, f"layer {layer_idx}: the native rows cover {start} of {n} tokens")


def _native_tokens_by_torch(
    q: torch.Tensor,
    caches: tuple[torch.Tensor, torch.Tensor],
    scales: tuple[torch.Tensor, torch.Tensor] | None,
    metadata: AttentionMetadata,
    group: GroupMetadata,
    attend: Attend,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """The native run's tokens `q` `[n, H, D]` attended through `attend` from the pages (each token's row,
    position and the group's window or chunk, as the kernel reads them), as one padded batch: for a layer
    the kernel cannot read. Returns `[n, H, D_v]`."""
    rows = present(metadata.token_row, "native tokens without their rows")
    positions = present(metadata.token_pos, "native tokens without their positions")
    first = torch.tensor(
        [first_visible_key(int(p), group.sliding_window, group.chunk_size) for p in positions.tolist()],
        device=positions.device,
    )
    span = int((positions - first).max()) + 1
    keys = first[:, None] + torch.arange(span, device=positions.device)  # [n, L] logical positions
    visible = keys <= positions[:, None]
    keys = torch.minimum(keys, positions[:, None])  # masked columns read a valid slot
    pages = torch.gather(group.block_table[rows].long(), 1, keys // metadata.cache.page_size)
    slots = pages * metadata.cache.page_size + keys % metadata.cache.page_size
    k_rows, v_rows = _gather_kv(caches, scales, slots, q.dtype)
    k, v = k_rows.transpose(1, 2), v_rows.transpose(1, 2)  # [n, Hkv, L, D]
    out = attend(q.unsqueeze(2), k, v, visible[:, None, None, :], False, scale, softcap, sinks)
    return out.squeeze(2)
