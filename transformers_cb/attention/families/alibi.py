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

Falcon (`alibi=True`) writes another form, `AlibiForm`: it rounds the slopes to bfloat16, multiplies them by
each key's absolute position and rounds that product to bfloat16 again, and the bias joins the logits
scaled as they are (`alibi / sqrt(D)` added to `q.k / sqrt(D)`). The per-key rounding is not shift-invariant,
so that form reads absolute key positions: a full-attention layer's gathered keys start at position 0, so the
j-th is at position j (the form is refused on windowed layers: `AlibiForm.check_layer`). The native kernel
adds only the relative float32 form; a step's tokens it would attend run through the torch kernels for the
layers of another form (attention/paged.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AlibiForm:
    """How a family adds its ALiBi bias: which positions it multiplies, rounded to what, scaled or not."""

    # Absolute key positions (`slope * key_pos`, the family rounds the product so a shift would change it)
    # instead of the distance to the query (`slope * (key_pos - query_pos)`, exact to float32).
    absolute: bool = False
    # The dtype the slopes, and each product, are rounded to as the family computes them (None: float32).
    rounding: torch.dtype | None = None
    # The bias multiplied by the layer's scaling, as when the family adds it to the unscaled logits.
    scaled: bool = False

    @property
    def native(self) -> bool:
        """Whether the native kernel adds this form (the relative float32 one only)."""
        return self == RELATIVE

    def check_layer(self, layer: str, sliding_window: int | None) -> None:
        """An absolute form needs the row's gathered keys to start at position 0: no sliding window."""
        if self.absolute and sliding_window is not None:
            raise NotImplementedError(
                f"{layer}: an ALiBi bias of absolute key positions on a sliding-window layer is not implemented"
            )

    def values(
        self, slopes: torch.Tensor, keys: torch.Tensor, own: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """The float32 bias of `slopes` `[H]` (as `[1, H, 1, 1]`) for key indices `keys` `[1, 1, 1, L]`, the
        query's own key index `own` (`[B, 1, Q, 1]`, or anything broadcast to it); `[B, H, Q, L]`."""
        slopes = slopes.view(1, -1, 1, 1)
        if self.absolute:
            positions = keys.expand(torch.broadcast_shapes(keys.shape, own.shape))  # the rows' shape
        else:
            positions = keys - own
        if self.rounding is not None:
            bias = (slopes.to(self.rounding) * positions).to(self.rounding).float()
        else:
            bias = slopes.float() * positions.float()
        # Divided by the inverse, as Falcon writes `alibi / sqrt(D)`: the same float32 rounding as its own.
        return bias / (1.0 / scale) if self.scaled else bias


# Bloom's and MPT's form (any, as they write it: softmax is shift-invariant) and the native kernel's.
RELATIVE = AlibiForm()
# Falcon's (`alibi=True`): `build_alibi_tensor`'s bfloat16 products of absolute positions, added as
# `alibi / sqrt(D)` to the scaled logits.
FALCON_FORM = AlibiForm(absolute=True, rounding=torch.bfloat16, scaled=True)


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
    slopes: torch.Tensor,
    mask: torch.Tensor | None,
    q_len: int,
    kv_len: int,
    device: torch.device,
    form: AlibiForm = RELATIVE,
    scale: float = 1.0,
) -> torch.Tensor:
    """`[B, H, Q, L]` float32 (B = 1 without a mask): `slope_h * (j - i_q)` for the j-th of a row's gathered
    keys, `i_q` the index of the query's own key among them (the last it sees: attention is causal), so
    the bias is 0 on the query's own key and exact to float32 however long the context; or the bias of
    another `form` (`scale`: the layer's, for a scaled form).

    Args:
        mask: `[B, 1, Q, L]` bool (True: attend) or None (bottom-right causal: query i is key L - Q + i)."""
    keys = torch.arange(kv_len, device=device)
    if mask is None:
        own = (keys[kv_len - q_len :]).view(1, 1, q_len, 1)
    else:
        own = torch.where(mask, keys, 0).amax(dim=-1, keepdim=True)  # [B, 1, Q, 1]
    if form == RELATIVE:
        distance = (keys.view(1, 1, 1, kv_len) - own).to(torch.float32)
        return slopes.to(device=device, dtype=torch.float32).view(1, -1, 1, 1) * distance
    return form.values(slopes.to(device), keys.view(1, 1, 1, kv_len), own, scale)
