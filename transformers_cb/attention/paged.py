"""Glue shared by the paged backends: write the step's new K/V, then attend group by group.

A backend only supplies `attend(q, k, v, mask, is_causal, scale)` over dense
per-group tensors; the paging (slot writes and gathers) lives here once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .metadata import AttentionMetadata

# attend(query [B, H, Q, D], key [B, Hkv, L, D], value [B, Hkv, L, D], mask [B, 1, Q, L] bool | None,
#        is_causal, scale) -> [B, H, Q, D]
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, bool, float], torch.Tensor]

METADATA_KWARG = "cb_attention_metadata"


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """`cache[slots]` as `[*slots.shape, Hkv, D]` through one index_select."""
    return cache.index_select(0, slots.reshape(-1)).view(*slots.shape, *cache.shape[1:])


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer_idx: int,
    metadata: AttentionMetadata,
    scale: float,
    attend: Attend,
) -> torch.Tensor:
    """Args: query `[1, H, T, D]`, key/value `[1, Hkv, T, D]` of the packed step.

    Returns `[1, T, H, D]`, the layout transformers' attention functions return.
    """
    group_metadata = metadata.group_of(layer_idx)
    q = query[0].transpose(0, 1)  # [T, H, D]
    new_keys = key[0].transpose(0, 1)  # [T, Hkv, D]
    new_values = value[0].transpose(0, 1)
    metadata.cache.write(layer_idx, group_metadata.slot_mapping, new_keys, new_values)
    key_cache, value_cache = metadata.cache.layer(layer_idx)
    out = torch.empty_like(q)  # [T, H, D]
    for group in group_metadata.decode_groups:
        q_group = q[group.q_start : group.q_end].unsqueeze(2)  # [B, H, 1, D]
        k_group = _gather(key_cache, group.kv_slots).transpose(1, 2)  # [B, Hkv, L, D]
        v_group = _gather(value_cache, group.kv_slots).transpose(1, 2)
        o = attend(q_group, k_group, v_group, group.kv_mask, False, scale)  # [B, H, 1, D]
        out[group.q_start : group.q_end] = o.squeeze(2)
    for group in group_metadata.prefill_groups:
        rows = slice(group.q_start, group.q_end)
        q_group = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, Q, D]
        if group.kv_slots is None:
            # First chunk of a sequence: its whole KV is this chunk (causal, or windowed by `mask`).
            k_group = new_keys[rows].transpose(0, 1).unsqueeze(0)  # [1, Hkv, Q, D]
            v_group = new_values[rows].transpose(0, 1).unsqueeze(0)
            o = attend(q_group, k_group, v_group, group.mask, group.q_end - group.q_start > 1, scale)
        else:
            k_group = _gather(key_cache, group.kv_slots).transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
            v_group = _gather(value_cache, group.kv_slots).transpose(0, 1).unsqueeze(0)
            o = attend(q_group, k_group, v_group, group.mask, False, scale)
        out[rows] = o[0].transpose(0, 1)
    return out.unsqueeze(0)


def make_paged_forward(attend: Attend, fallback: Callable, name: str) -> Callable:
    """The function registered in transformers' `AttentionInterface` for one paged backend.

    Inside continuous batching (metadata in the kwargs) it runs `paged_attention` with `attend`;
    otherwise (e.g. plain `generate()` on a paged model) it behaves like `fallback`.
    """

    def forward(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        metadata = kwargs.pop(METADATA_KWARG, None)
        if metadata is None:
            return fallback(
                module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
            )
        unsupported_kwargs(kwargs)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return paged_attention(query, key, value, module.layer_idx, metadata, scale, attend), None

    forward.__name__ = forward.__qualname__ = name
    return forward


def unsupported_kwargs(kwargs: dict) -> None:
    """Refuse attention variants this backend does not implement, instead of ignoring them."""
    for name in ("sliding_window", "softcap", "s_aux", "sinks"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"paged attention with {name}={kwargs[name]!r} is not implemented yet")
