"""`paged|sdpa`: torch's scaled_dot_product_attention over gathered pages.

SDPA has no softcap argument and no attention sinks, so a layer that applies either
runs the eager kernel instead (never silently without them); every other layer runs SDPA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .eager import eager_attend, eager_attention_forward
from .paged import make_paged_forward


def sdpa_attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    if softcap is not None or sinks is not None:
        return eager_attend(query, key, value, mask, is_causal, scale, softcap, sinks)
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, is_causal=is_causal and mask is None, scale=scale, enable_gqa=True
    )


sdpa_paged_attention_forward = make_paged_forward(
    sdpa_attend,
    sdpa_attention_forward,
    "sdpa_paged_attention_forward",
    plain_fallback=eager_attention_forward,
)
