"""`paged|sdpa`: torch's scaled_dot_product_attention over gathered pages."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .paged import METADATA_KWARG, paged_attention, unsupported_kwargs


def sdpa_attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
) -> torch.Tensor:
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, is_causal=is_causal and mask is None, scale=scale, enable_gqa=True
    )


def sdpa_paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    metadata = kwargs.pop(METADATA_KWARG, None)
    if metadata is None:
        # Not inside continuous batching (e.g. plain `generate()`): behave like `sdpa`.
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    unsupported_kwargs(kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return paged_attention(query, key, value, module.layer_idx, metadata, scale, sdpa_attend), None
