"""`paged|sdpa`: torch's scaled_dot_product_attention over gathered pages.

SDPA has no softcap argument and no attention sinks, so a layer that applies either
runs the eager kernel instead (never silently without them); every other layer runs SDPA, an ALiBi
layer with its bias as a float mask (attention/families/alibi.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ..families.alibi import RELATIVE, AlibiForm, alibi_bias
from ..paged import make_paged_forward
from .eager import eager_attend, eager_attention_forward


def sdpa_attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    slopes: torch.Tensor | None = None,
    alibi_form: AlibiForm = RELATIVE,
) -> torch.Tensor:
    if softcap is not None or sinks is not None:
        return eager_attend(query, key, value, mask, is_causal, scale, softcap, sinks, slopes, alibi_form)
    if slopes is not None:
        q_len, kv_len = query.shape[2], key.shape[2]
        if mask is None and is_causal:
            mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)
        bias = alibi_bias(slopes, mask, q_len, kv_len, query.device, alibi_form, scale).to(
            query.dtype
        )  # [B, H, Q, L]
        if mask is not None:
            bias = torch.where(mask.view(-1, 1, q_len, kv_len), bias, float("-inf"))
        return F.scaled_dot_product_attention(query, key, value, attn_mask=bias, scale=scale, enable_gqa=True)
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, is_causal=is_causal and mask is None, scale=scale, enable_gqa=True
    )


sdpa_paged_attention_forward = make_paged_forward(
    sdpa_attend,
    sdpa_attention_forward,
    "sdpa_paged_attention_forward",
    plain_fallback=eager_attention_forward,
)
