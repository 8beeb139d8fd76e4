"""`paged|eager`: plain matmul + softmax over gathered pages, GQA without repeating KV."""

from __future__ import annotations

import torch

from .paged import make_paged_forward


def eager_attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
) -> torch.Tensor:
    batch, num_heads, q_len, head_dim = query.shape
    num_kv_heads, kv_len = key.shape[1], key.shape[2]
    group = num_heads // num_kv_heads
    # Query head h uses KV head h // group, so grouping heads as [Hkv, group] needs no KV copy.
    q = query.reshape(batch, num_kv_heads, group * q_len, head_dim)
    scores = torch.matmul(q, key.transpose(-1, -2)) * scale  # [B, Hkv, group * Q, L]
    scores = scores.view(batch, num_kv_heads, group, q_len, kv_len)
    if is_causal and mask is None:
        mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)
    if mask is not None:
        scores = scores.masked_fill(~mask.view(-1, 1, 1, q_len, kv_len), float("-inf"))
    probs = scores.softmax(dim=-1, dtype=torch.float32).to(value.dtype)
    out = torch.matmul(
        probs.view(batch, num_kv_heads, group * q_len, kv_len), value
    )  # [B, Hkv, group * Q, D]
    return out.view(batch, num_heads, q_len, head_dim)


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
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-paged eager attention (used when a `paged|eager` model runs plain `generate()`)."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    group = query.shape[1] // key.shape[1]
    key, value = _repeat_kv(key, group), _repeat_kv(value, group)
    scores = torch.matmul(query, key.transpose(2, 3)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if attention_mask is not None:
        mask = attention_mask[:, :, :, : key.shape[-2]]
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    probs = scores.softmax(dim=-1, dtype=torch.float32).to(query.dtype)
    probs = torch.nn.functional.dropout(probs, p=dropout, training=module.training)
    out = torch.matmul(probs, value).transpose(1, 2).contiguous()
    return out, probs


eager_paged_attention_forward = make_paged_forward(
    eager_attend, eager_attention_forward, "eager_paged_attention_forward"
)
