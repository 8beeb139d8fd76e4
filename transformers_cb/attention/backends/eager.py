"""`paged|eager`: plain matmul + softmax over gathered pages, GQA without repeating KV.

It applies every logit transform a model's own eager attention does: scaling, logit
softcapping (Gemma 2), ALiBi biases (Bloom, MPT: attention/families/alibi.py), masking (causal, sliding window,
padding) and attention sinks (GPT-OSS: one extra logit per head that takes probability mass but has no value).
"""

from __future__ import annotations

import torch

from ..families.alibi import RELATIVE, AlibiForm, alibi_bias
from ..paged import make_paged_forward


def _softcapped(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return scores if softcap is None else softcap * torch.tanh(scores / softcap)


def _softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim in fp32; with `sinks` (broadcastable to `scores[..., :1]`) the sink
    logit joins the normalisation and is dropped afterwards."""
    if sinks is None:
        return scores.softmax(dim=-1, dtype=torch.float32)
    sink_column = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
    return torch.cat([scores, sink_column], dim=-1).softmax(dim=-1, dtype=torch.float32)[..., :-1]


def eager_attend(
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
    """slopes: `[H]` ALiBi slopes (None: no bias); the keys of each row are consecutive positions."""
    batch, num_heads, q_len, head_dim = query.shape
    num_kv_heads, kv_len = key.shape[1], key.shape[2]
    group = num_heads // num_kv_heads
    # Query head h uses KV head h // group, so grouping heads as [Hkv, group] needs no KV copy.
    q = query.reshape(batch, num_kv_heads, group * q_len, head_dim)
    scores = torch.matmul(q, key.transpose(-1, -2)) * scale  # [B, Hkv, group * Q, L]
    scores = _softcapped(scores.view(batch, num_kv_heads, group, q_len, kv_len), softcap)
    if slopes is not None:  # in float32, as the reference and the native kernel add it
        bias = alibi_bias(slopes, mask, q_len, kv_len, query.device, alibi_form, scale)
        scores = scores.float() + bias.view(bias.shape[0], num_kv_heads, group, q_len, kv_len)
    if is_causal and mask is None:
        mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)
    if mask is not None:
        scores = scores.masked_fill(~mask.view(-1, 1, 1, q_len, kv_len), float("-inf"))
    head_sinks = None if sinks is None else sinks.view(1, num_kv_heads, group, 1, 1)
    probs = _softmax_with_sinks(scores, head_sinks).to(value.dtype)
    out = torch.matmul(
        probs.view(batch, num_kv_heads, group * q_len, kv_len), value
    )  # [B, Hkv, group * Q, D_v]
    return out.view(batch, num_heads, q_len, value.shape[-1])  # V's head size may not be K's


def _repeat_kv(states: torch.Tensor, group: int) -> torch.Tensor:
    return states if group == 1 else states.repeat_interleave(group, dim=1)


def eager_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-paged eager attention (used when a paged model runs plain `generate()`).

    A missing mask means plain causal attention (what an SDPA mask builder returns None for).
    """
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    group = query.shape[1] // key.shape[1]
    key, value = _repeat_kv(key, group), _repeat_kv(value, group)
    scores = _softcapped(torch.matmul(query, key.transpose(2, 3)) * scale, softcap)
    q_len, kv_len = scores.shape[-2], scores.shape[-1]
    if attention_mask is None:
        attention_mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)
        attention_mask = attention_mask.view(1, 1, q_len, kv_len)
    mask = attention_mask[:, :, :, :kv_len]
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    sinks = None if s_aux is None else s_aux.view(1, -1, 1, 1)
    probs = _softmax_with_sinks(scores, sinks).to(query.dtype)
    probs = torch.nn.functional.dropout(probs, p=dropout, training=module.training)
    out = torch.matmul(probs, value).transpose(1, 2).contiguous()
    return out, probs


eager_paged_attention_forward = make_paged_forward(
    eager_attend, eager_attention_forward, "eager_paged_attention_forward"
)
