"""Pure-torch reference paged attention: slow, obvious, and the oracle for every backend.

Same signature as a varlen flash kernel with block tables: queries are packed
`[T, H, D]`, request `i` owns queries `cu_seqlens_q[i]:cu_seqlens_q[i+1]` and
attends causally (bottom-right aligned) to its first `seq_lens_k[i]` KV tokens,
found through `block_table[i]`.
"""

from __future__ import annotations

import torch

from .families.alibi import RELATIVE, AlibiForm


def reference_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
    block_table: torch.Tensor,
    page_size: int,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    chunk_size: int | None = None,
    slopes: torch.Tensor | None = None,
    alibi_form: AlibiForm = RELATIVE,
) -> torch.Tensor:
    """Args: query `[T, H, D]`; key/value cache `[num_slots, Hkv, D]`; sliding_window: a query at
    position q sees keys (q - sliding_window, q]; chunk_size: a query at q sees keys
    [q // chunk_size * chunk_size, q] (chunked attention); softcap: `softcap * tanh(scores / softcap)`;
    sinks: `[H]` logits that join each head's softmax without a value; slopes: `[H]` ALiBi slopes, the
    bias `slope_h * (key_pos - query_pos)` added to the scaled logits, or the bias of another `alibi_form`
    (Falcon's: `round(round(slope_h) * key_pos) * scale`, rounded as the form says). Returns `[T, H, D]`."""
    num_heads, num_kv_heads = query.shape[1], key_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    for i in range(len(seq_lens_k)):
        q_start, q_end = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        kv_len = int(seq_lens_k[i])
        positions = torch.arange(kv_len)
        slots = block_table[i, positions // page_size].long() * page_size + positions % page_size
        k = key_cache[slots].float().repeat_interleave(group, dim=1)  # [L, H, D]
        v = value_cache[slots].float().repeat_interleave(group, dim=1)
        q = query[q_start:q_end].float()  # [Q, H, D]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(kv_len - (q_end - q_start), kv_len)[:, None]
        if slopes is not None and alibi_form == RELATIVE:
            scores = scores + slopes.float().view(-1, 1, 1) * (positions[None, :] - q_pos).float()
        elif slopes is not None:
            own = q_pos.view(1, 1, -1, 1)
            scores = scores + alibi_form.values(slopes, positions.view(1, 1, 1, -1), own, scale)[0]
        allowed = positions[None, :] <= q_pos
        if sliding_window is not None:
            allowed &= positions[None, :] > q_pos - sliding_window
        if chunk_size is not None:
            allowed &= positions[None, :] >= q_pos // chunk_size * chunk_size
        scores = scores.masked_fill(~allowed, float("-inf"))
        if sinks is not None:
            sink_column = sinks.float().view(-1, 1, 1).expand(-1, scores.shape[1], 1)
            scores = torch.cat([scores, sink_column], dim=-1)
        probs = scores.softmax(dim=-1)[..., :kv_len]
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out
