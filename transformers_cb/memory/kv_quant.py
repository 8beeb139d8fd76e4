"""The int8 KV cache's numbers (`ContinuousBatchingConfig.kv_cache_dtype="int8"`): how a token's K/V row
is quantized when written, dequantized when read, what a token costs, and where it cannot run.

Symmetric per (token slot, KV head): `scale = absmax / 127` over the head's values, `q = round(x / scale)`
in [-127, 127], `x ~ q * scale`. A row of zeros (or the zero-filled pages nothing wrote) gets scale 1 and
reads back 0, never NaN. Scales are float32 side tensors addressed like the pages
(`PagedKVCache.scale_tensors`), so every move of a page (forks, swaps, prefix sharing, release) moves
them too. docs/quantization.md, "int8 KV cache", states what this equals (and what it does not).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..kv.layer_groups import KVGroupSpec

INT8 = "int8"
SCALE_DTYPE = torch.float32
SCALE_BYTES = 4  # one float32 scale per (token, KV head) and stream (K, V)
QMAX = 127.0


def storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the KV pages are stored in: int8, or the model's own ("auto")."""
    return torch.int8 if kv_cache_dtype == INT8 else model_dtype


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` `[..., D]` as int8 `[..., D]` and its float32 scales `[...]` (absmax / 127; 1 for a zero row)."""
    values = x.float()
    scale = values.abs().amax(dim=-1) / QMAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(values / scale.unsqueeze(-1)).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 `q` `[..., D]` with its scales `[...]` as `dtype` (the product taken in float32)."""
    return (q.float() * scale.unsqueeze(-1)).to(dtype)


def round_trip(x: torch.Tensor) -> torch.Tensor:
    """`x` as the int8 cache gives it back (what a token attends when it reads its own K/V from a page)."""
    q, scale = quantize(x)
    return dequantize(q, scale, x.dtype)


def int8_cache_problem(groups: Sequence[KVGroupSpec], attn_implementation: str | None) -> str | None:
    """Why an int8 KV cache cannot run with these KV groups and this attention backend (None: it can).

    The rows the kernels quantize are one head's K or V: a multi-latent group (one latent row, decompressed
    by the module), a group whose rows hold K and V side by side (V's head size not K's) or an indexer key
    beside the latent would need scales per part of a row, which are not built. The flash backends read
    the pages in their own kernels, which take no int8 pages: they are refused, not dequantized (the torch
    backends `paged|sdpa` / `paged|eager` dequantize on any device)."""
    for spec in groups:
        if spec.latent:
            return "a multi-latent attention group (its latent rows)"
        if spec.value_dim is not None:
            return "a group whose V head size is not K's (K and V side by side in one row)"
        if spec.index_dim is not None:
            return "a group caching an indexer key beside its rows"
    if attn_implementation is not None and "flash" in attn_implementation:
        return f"the {attn_implementation} backend (its kernels read float pages; use paged|sdpa)"
    return None
