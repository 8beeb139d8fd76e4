"""ALiBi: a per-head linear bias on the attention logits, `slope_h * (key_pos - query_pos)`.

The kernels add it from positions they already know (the key's index in the gathered keys, or its position
in the native kernel), never from a bias tensor the model builds: a paged step has no `[H, Q, L]` bias of
the packed tokens. Within one query's row the bias only needs to be right up to a constant (softmax is
shift-invariant row-wise), so Bloom's `slope * key_pos`, MPT's `slope * (key_pos - (L - 1))` and the paper's
`slope * (key_pos - query_pos)` give one result. The kernels add the last: it is 0 on the query's own key,
so a long context loses no precision in the recent keys that matter. The gathered keys of a row are
consecutive positions, so the distance is one of key indices (`alibi_bias`); the native kernel has the
positions themselves.

The slopes are each family's own (`bloom_slopes`, `mpt_slopes`), computed as the family does in float32.
"""

from __future__ import annotations

import math

import torch


def bloom_slopes(num_heads: int) -> torch.Tensor:
    """Bloom's (and Falcon's) slopes `[H]` float32: the geometric series of the ALiBi paper, with the odd
    powers of the next power of two's base for the heads beyond the largest power of two."""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = torch.tensor(2 ** (-(2 ** -(math.log2(closest) - 3))), dtype=torch.float32)
    slopes = torch.pow(base, torch.arange(1, 1 + closest, dtype=torch.int32))
    if closest != num_heads:
        extra_base = torch.tensor(2 ** (-(2 ** -(math.log2(2 * closest) - 3))), dtype=torch.float32)
        remaining = min(closest, num_heads - closest)
        extra = torch.pow(extra_base, torch.arange(1, 1 + 2 * remaining, 2, dtype=torch.int32))
        slopes = torch.cat([slopes, extra])
    return slopes


def mpt_slopes(num_heads: int, alibi_bias_max: float = 8) -> torch.Tensor:
    """MPT's slopes `[H]` float32: `1 / 2^(i * alibi_bias_max / H2)` over the next power of two `H2`, the odd
    ones first when `H` is not a power of two (`build_mpt_alibi_tensor`)."""
    padded = 2 ** math.ceil(math.log2(num_heads))
    base = torch.arange(1, padded + 1, dtype=torch.int64).float() * (alibi_bias_max / padded)
    slopes = 1.0 / torch.pow(2, base)
    if padded != num_heads:
        slopes = torch.cat([slopes[1::2], slopes[::2]])[:num_heads]
    return slopes


def alibi_bias(
    slopes: torch.Tensor, mask: torch.Tensor | None, q_len: int, kv_len: int, device: torch.device
) -> torch.Tensor:
    """`[B, H, Q, L]` float32 (B = 1 without a mask): `slope_h * (j - i_q)` for the j-th of a row's gathered
    keys, `i_q` the index of the query's own key among them (the last it sees: attention is causal), so
    the bias is 0 on the query's own key and exact to float32 however long the context.

    Args:
        mask: `[B, 1, Q, L]` bool (True: attend) or None (bottom-right causal: query i is key L - Q + i)."""
    keys = torch.arange(kv_len, device=device)
    if mask is None:
        own = (keys[kv_len - q_len :]).view(1, 1, q_len, 1)
    else:
        own = torch.where(mask, keys, 0).amax(dim=-1, keepdim=True)  # [B, 1, Q, 1]
    distance = (keys.view(1, 1, 1, kv_len) - own).to(torch.float32)
    return slopes.to(device=device, dtype=torch.float32).view(1, -1, 1, 1) * distance
