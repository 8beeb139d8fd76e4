"""Llama 4's attention temperature tuning on its NoPE layers, scaled by each token's own position.

A NoPE layer (`use_rope` false) with `attn_temperature_tuning` multiplies its queries by
`log1p(floor((p + 1) / floor_scale)) * attn_scale + 1` at position `p` before calling the attention
function; it numbers the positions itself, `arange(tokens) + past_key_values.get_seq_length()`, not from
`position_ids`. In a packed step (no cache object, every request's tokens in one row) that numbering is
the token's index in the step, not its position in its sequence, so the glue (`paged.make_forward`)
replaces the scale the module applied by the one of the token's position (`AttentionMetadata.position_ids`).

Exact while a step has fewer than `floor_scale` tokens (8192 for Llama 4): the module's scale is then
1 for every token, so its queries are the unscaled ones and the rescale is the module's own product; a
longer step divides by the module's scale first (within a rounding of `generate()`).
"""

from __future__ import annotations

import torch


def scales(positions: torch.Tensor, floor_scale: float, attn_scale: float) -> torch.Tensor:
    """The temperature of each position, as transformers' `Llama4TextAttention` computes it (float32)."""
    return torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0


def tunes_temperature(module: torch.nn.Module) -> bool:
    """Whether `module` scales its queries by a temperature of the position it numbers itself."""
    # read from the instance's (or class's) own attributes: on a module without them, `getattr` goes through
    # `nn.Module.__getattr__` and an exception, and this runs at every layer of every decode step
    own = module.__dict__
    tuning = own.get("attn_temperature_tuning", getattr(type(module), "attn_temperature_tuning", False))
    return bool(tuning) and not getattr(module, "use_rope", True)


def retuned_query(module: torch.nn.Module, query: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """`query` `[1, H, T, D]` of a packed step, scaled by the temperature of each token's position
    `positions` `[T]` instead of the one the module applied (its step index)."""
    floor_scale = float(getattr(module, "floor_scale"))  # noqa: B009 (a Module attribute, not a Tensor)
    attn_scale = float(getattr(module, "attn_scale"))  # noqa: B009
    num_tokens = query.shape[2]
    wanted = scales(positions.to(query.device), floor_scale, attn_scale)
    # The module's scale at step index t is 1 while (t + 1) // floor_scale is 0, i.e. for every t of a step
    # shorter than floor_scale (decided from shapes: no data-dependent branch in a compiled forward).
    if num_tokens >= floor_scale and attn_scale != 0:
        applied = scales(torch.arange(num_tokens, device=query.device), floor_scale, attn_scale)
        query = (query.float() / applied.view(1, 1, -1, 1)).to(query.dtype)  # exact up to rounding
    return (query * wanted.view(1, 1, -1, 1)).to(query.dtype)
