"""Integer weights with group scales written as GGUF blocks: what other libraries' symmetric int4 / int8 weights
are in the layout the native products read (runner/products/quantized_linear.py).

A symmetric int4 value `q` (in [-8, 7]) with its scale `s` is exactly a Q4_0 block's weight `d * (nibble - 8)`
with `nibble = q + 8`, `d = s`; a symmetric int8 one is a Q8_0 block's `d * q`. A block holds 32 weights of a
row and stores `d` in float16, so `blocks_from_values` takes values whose groups are whole blocks and scales
that are float16 values (a bfloat16 model's are, away from float16's range limits), and says why not
otherwise. Used for compressed-tensors checkpoints (engine/weights/compressed_weights.py) and torchao's
`IntxWeightOnlyConfig` weights (runner/products/torchao_linear.py).
"""

from __future__ import annotations

import torch

from .quantized_linear import BLOCK_WEIGHTS, Q4_0, Q8_0

QTYPE_OF_BITS = {4: Q4_0, 8: Q8_0}


def blocks_from_values(
    values: torch.Tensor, scales: torch.Tensor, bits: int
) -> tuple[torch.Tensor, int] | str:
    """The GGUF blocks `[N, row bytes]` (and their type) of the weight `values * scales`: `values` `[N, K]`
    signed integers of `bits` (4 or 8) bits in any integer dtype, `scales` one per row and group of
    whole blocks (`[N, G]`, G dividing K / 32) or one for all; or why they cannot be blocks."""
    if bits not in QTYPE_OF_BITS:
        return f"{bits}-bit values (int4 and int8 only)"
    rows, columns = values.shape
    if columns % BLOCK_WEIGHTS:
        return f"{columns} inputs are not whole blocks of {BLOCK_WEIGHTS}"
    blocks_per_row = columns // BLOCK_WEIGHTS
    if scales.numel() == 1:
        per_block = scales.reshape(1, 1).expand(rows, blocks_per_row)
    else:
        groups = scales.reshape(rows, -1) if scales.numel() % rows == 0 else None
        if groups is None or blocks_per_row % groups.shape[1]:
            return f"scales {tuple(scales.shape)} are not one a row and group of whole blocks over {columns} inputs"
        per_block = groups.repeat_interleave(blocks_per_row // groups.shape[1], dim=1)
    d = per_block.to(torch.float16)
    if not torch.equal(d.to(per_block.dtype), per_block) or not bool(torch.isfinite(d).all()):
        return "its scales are not float16 values (blocks store float16 scales)"
    limit = 1 << (bits - 1)
    if bool((values < -limit).any()) or bool((values >= limit).any()):
        return f"values outside the {bits}-bit range"
    grouped = values.to(torch.int16).reshape(rows, blocks_per_row, BLOCK_WEIGHTS)
    if bits == 4:  # Q4_0's byte j of a block: weights j (low nibble) and j + 16 (high)
        nibbles = (grouped + 8).to(torch.uint8)
        packed = nibbles[..., : BLOCK_WEIGHTS // 2] | (nibbles[..., BLOCK_WEIGHTS // 2 :] << 4)
    else:
        packed = grouped.to(torch.int8).view(torch.uint8)
    scale_bytes = d.contiguous().view(torch.uint8).reshape(rows, blocks_per_row, 2)
    return torch.cat((scale_bytes, packed), dim=-1).reshape(rows, -1).contiguous(), QTYPE_OF_BITS[bits]
