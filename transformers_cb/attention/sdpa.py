"""`paged|sdpa`: torch's scaled_dot_product_attention over gathered pages."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .paged import make_paged_forward


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


sdpa_paged_attention_forward = make_paged_forward(
    sdpa_attend, sdpa_attention_forward, "sdpa_paged_attention_forward"
)
