"""`paged|flash_attention_2`, `paged|flash_attention_3`, `paged|kernels-community/flash-attn*`.

The paged cache of a layer (`[num_slots, Hkv, D]`) is viewed as flash-attn's paged layout
`[num_pages, page_size, Hkv, D]`, and each step is one kernel call per layer:

- mixed steps: `flash_attn_varlen_func(q, k_pages, v_pages, cu_seqlens_q, cu_seqlens_k | seqused_k,
  max_seqlen_q, max_seqlen_k, block_table=..., causal=True, window_size, softcap[, s_aux])` after the
  step's new K/V are written to their slots; flash-attn 3, whose varlen function reads no page table,
  runs the same step through `flash_attn_with_kvcache(q, ..., page_table, cache_seqlens, cu_seqlens_q)`;
- decode-only steps with a `DecodeFastPath`: `flash_attn_with_kvcache(q [B, 1, H, D], k_pages, v_pages,
  k=new_k, v=new_v, cache_seqlens, block_table)`, which writes the new K/V in place and attends.

Sliding layers pass `window_size=(window - 1, 0)`: a query at position p sees keys (p - window, p], the
window our sliding KV groups keep (their stale ring entries lie outside it, so they are never read).
Outside continuous batching (plain `generate()` on a model set to a paged flash name) these backends run
transformers' SDPA attention, with eager for softcapping / sinks, like `paged|sdpa`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ..metadata import AttentionMetadata
from ..paged import make_forward
from .eager import eager_attention_forward
from .flash_kernels import FlashKernel, load_flash_kernel


def _window_size(window: int | None) -> tuple[int, int]:
    return (-1, -1) if window is None else (window - 1, 0)


def _sinks_kwargs(kernel: FlashKernel, args: frozenset[str], sinks: torch.Tensor | None) -> dict:
    if sinks is None:
        return {}
    name = kernel.sinks_arg(args)
    if name is None:
        raise NotImplementedError(
            f"{kernel.name} takes no attention sinks, which this layer applies (s_aux); "
            "use 'paged|eager' or 'paged|sdpa' for this model"
        )
    return {name: sinks}


def flash_paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer_idx: int,
    metadata: AttentionMetadata,
    scale: float,
    kernel: FlashKernel,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Args as `paged.paged_attention`: query `[1, H, T, D]`, key/value `[1, Hkv, T, D]`. Returns `[1, T, H, D]`."""
    group = metadata.group_of(layer_idx)
    if metadata.cache.key_dim(metadata.cache.layer_group[layer_idx]) is not None:
        raise NotImplementedError(
            f"layer {layer_idx} attends with a V head size other than K's, whose pages (K and V side by side "
            "in one row) the flash kernels do not read; use 'paged|eager' or 'paged|sdpa' for this model"
        )
    q = query[0].transpose(0, 1)  # [T, H, D]
    new_keys = key[0].transpose(0, 1)  # [T, Hkv, D]
    new_values = value[0].transpose(0, 1)
    key_cache, value_cache = metadata.cache.layer(layer_idx)
    page_size = metadata.cache.page_size
    key_pages = key_cache.view(-1, page_size, *key_cache.shape[1:])  # [num_pages, page_size, Hkv, D]
    value_pages = value_cache.view(-1, page_size, *value_cache.shape[1:])
    common = {
        "softmax_scale": scale,
        "causal": True,
        "window_size": _window_size(group.sliding_window),
        "softcap": 0.0 if softcap is None else softcap,
    }
    fast = metadata.decode_fast_path
    if fast is not None and group.sliding_window is None:
        # Only a kernel with a paged kvcache entry point gets the fast path (fast_path.py).
        out = cast(Callable, kernel.with_kvcache)(
            q.unsqueeze(1),
            key_pages,
            value_pages,
            k=new_keys.unsqueeze(1).to(key_cache.dtype),
            v=new_values.unsqueeze(1).to(value_cache.dtype),
            cache_seqlens=fast.cache_seqlens,
            **{cast(str, kernel.kvcache_table_arg): fast.block_table},
            **common,
            **_sinks_kwargs(kernel, kernel.kvcache_args, sinks),
        )  # [B, 1, H, D]
        return out.reshape(1, *q.shape)
    metadata.cache.write(layer_idx, group.slot_mapping, new_keys, new_values)
    if kernel.varlen_table_arg is not None:
        lengths = (
            {"seqused_k": metadata.seq_lens_k}
            if "seqused_k" in kernel.varlen_args
            else {"cu_seqlens_k": metadata.cu_seqlens_k}
        )
        out = kernel.varlen(
            q,
            key_pages,
            value_pages,
            cu_seqlens_q=metadata.cu_seqlens_q,
            max_seqlen_q=metadata.max_seqlen_q,
            max_seqlen_k=metadata.max_seqlen_k,
            **lengths,
            **{kernel.varlen_table_arg: group.block_table},
            **common,
            **_sinks_kwargs(kernel, kernel.varlen_args, sinks),
        )
    else:  # flash-attn 3: packed queries through the paged kvcache entry point
        out = cast(Callable, kernel.with_kvcache)(
            q,
            key_pages,
            value_pages,
            cache_seqlens=metadata.seq_lens_k,
            cu_seqlens_q=metadata.cu_seqlens_q,
            max_seqlen_q=metadata.max_seqlen_q,
            **{cast(str, kernel.kvcache_table_arg): group.block_table},
            **common,
            **_sinks_kwargs(kernel, kernel.kvcache_args, sinks),
        )
    out = out[0] if isinstance(out, tuple) else out
    return out.unsqueeze(0)


def make_flash_forward(name: str) -> Callable:
    """The function registered in transformers' `AttentionInterface` for flash backend `name`."""

    def run(
        query, key, value, layer_idx, metadata, scale, softcap, sinks, slopes=None, alibi_form=None
    ) -> torch.Tensor:
        if slopes is not None:
            raise NotImplementedError(
                f"layer {layer_idx}: ALiBi biases are not implemented by the paged flash kernels; load the "
                "model with 'sdpa' or 'paged|sdpa'"
            )
        kernel = load_flash_kernel(name)
        return flash_paged_attention(query, key, value, layer_idx, metadata, scale, kernel, softcap, sinks)

    return make_forward(
        run, sdpa_attention_forward, f"flash_paged_attention_forward[{name}]", eager_attention_forward
    )
