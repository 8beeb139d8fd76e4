"""Small-row products: a few bfloat16 or float32 rows through the native library instead of oneDNN's call.

A decode step with a few requests multiplies a few rows by every weight. oneDNN's packed call costs 20-40 us
whatever the product's size on these CPUs, and it streams a weight that is not in cache at 10-15 GB/s
here. Over 30 different weights (cold, as a step reads them), SmolLM2's shapes, 2 threads:

| rows | 3072 x 576 oneDNN / native | 960 x 576 | 576 x 1536 | 576 x 576 |
|---|---|---|---|---|
| 1 | 122 / 112 us | 49 / 28 | 59 / 41 | 52 / 18 |
| 4 | 163 / 89 | 47 / 29 | 65 / 40 | 38 / 18 |
| 16 | 127 / 97 | 51 / 31 | 65 / 42 | 42 / 20 |
| 32 | 187 / 156 | 55 / 50 | 76 / 65 | 42 / 26 |

(`bf16_rows_matmul`, attention/native/native_rows_source.py, with AMX tiles: the same tile products as
oneDNN's, so the same bits in every case measured.) One or two rows run a `vdpbf16ps` loop instead (a
little faster there: 87-173 against 115-239 us for 3072 x 576, alternated runs); without AMX (Zen 4) that
loop (32 products a cycle) serves every row count, and wins up to 4-6 rows only. So each product picks by its row count (`row_limit`): up to
32 rows with AMX (a width that is a multiple of 32), else up to 4, up to 8 for a weight of at most 2^17
elements (where oneDNN's fixed cost dominates); none for an LM head (over 16384 outputs: its second pack
would be the largest).

The native loop reads the weight in its own layout (`pack_rows`: 16 columns a block, K in pairs), made
once per pack from oneDNN's own pack (`to_dense`) the first time a pack serves a small-row product, and
dropped with it (`packed_linear.Pack.rows_pack`): a stale pack is rebuilt with its row pack. It rounds where
oneDNN's bf16 product rounds (float32 sums, the bias added in float32, one rounding to bfloat16); the
float32 sums run in another order, as the packed products' already do against `F.linear`'s, so bf16 outputs
are judged tie-aware as before.

float32 (`f32_rows_matmul`, any AVX-512 CPU): a row pack `[NB, K, 16]` (16 columns a block, k-major), each
column's sum one chain of fused multiply-adds over k in order, the bias added after; up to `F32_ROWS` rows
on an AMX CPU, `NO_AMX_F32_ROWS` otherwise, for every weight, LM heads included. Over 16 cold weights, one thread: 1.2-1.6x faster than oneDNN's packed
call and MKL's `F.linear` at 1-32 rows on the small model's and SmolLM2's shapes, 1.1-1.35x on their LM heads
(docs/design.md, "Small-row products"). Its sums run in another order than oneDNN's (as oneDNN's do against MKL's): float32 greedy
outputs stay equal to `generate()` up to a near-tie, as the packed products' already do. The memory check
counts the second copy.

`TRANSFORMERS_CB_SMALL_ROW_PRODUCTS=0` turns it off (read when a pack first serves a product); without the native library or a CPU with AVX512-BF16
(the function is not built) oneDNN's product runs.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Protocol

import torch
import torch.nn.functional as F

from ...attention.native.kernel import native_module

ENV_SWITCH = "TRANSFORMERS_CB_SMALL_ROW_PRODUCTS"


class RowPacked(Protocol):
    """What the small-row product reads and keeps on a pack (`packed_linear.Pack`)."""

    packed: torch.Tensor
    rows_pack: torch.Tensor | None
    row_limit: int | None


# Outputs above which a weight keeps oneDNN's product at every row count on an AMX CPU (LM heads).
MAX_COLUMNS = 16384
# Elements up to which a weight takes the native product up to `TINY_ROWS` rows.
TINY_WEIGHT = 1 << 17
TINY_ROWS = 8
ROWS = 4
# With AMX tiles (16 rows x 32 columns a tile): as far as measured faster than oneDNN's call.
AMX_ROWS = 32
# Without AMX (AVX512-BF16 alone: AMD Zen 4): faster than oneDNN's call at every row count up to 64 on every
# shape measured (the small model's and SmolLM2's, LM heads included: 1.25-2.5x at 16 rows, 1.2-1.5x at 32,
# 1.01-1.47x at 48 and 64; docs/benchmarks.md, "Issue 46, eighth sitting" and "thirteenth sitting"); from 96
# rows a gate/up weight of 3,072 columns is not. `TINY_ROWS` / `ROWS` stay for a width AMX tiles do not take
# on an AMX CPU.
NO_AMX_ROWS = 64
# float32, on an AMX CPU as far as measured there (1.35x oneDNN's packed call at 32 rows); without AMX (Zen 4)
# 1.02-1.52x oneDNN's call at 33-64 rows on every shape measured (the same sitting).
F32_ROWS = 32
NO_AMX_F32_ROWS = 64
# float32 on an AVX2-only CPU (8 lanes, 16 registers: AMD Zen 3), 2 threads, cold weights of the small model
# and SmolLM2, LM heads included, K in stretches of 128: 1.05-2.5x oneDNN's packed call at 1-16 rows, 1.0-1.7x
# at 24 and 32, 1.02-1.37x at 48 and 64 on all but SmolLM2's 960 x 576 (0.89-0.99); a 64-row decode step of the
# small model 79 -> 67 ms (docs/design.md, "AVX2-only CPUs: AMD Zen 3").
AVX2_F32_ROWS = 64
# The native function of each dtype's product.
FUNCTIONS = {torch.bfloat16: "bf16_rows_matmul", torch.float32: "f32_rows_matmul"}


def row_limit(
    out_features: int,
    in_features: int,
    amx: bool = False,
    dtype: torch.dtype = torch.bfloat16,
    lanes: int = 16,
) -> int:
    """The most rows a product of this weight runs natively (0: never); `amx`: the library runs AMX tiles
    on this CPU (`bf16_rows_amx()`), which it does for a bf16 width that is a multiple of 32; `lanes`: the
    float32 product's vector width (`f32_rows_lanes()`: 16 with AVX-512, 8 with AVX2 alone)."""
    if dtype == torch.float32:
        if lanes < 16:
            return AVX2_F32_ROWS
        return F32_ROWS if amx else NO_AMX_F32_ROWS  # an LM head too: 1.1-1.35x oneDNN's call at 1-32 rows
    if not amx:
        return NO_AMX_ROWS  # an LM head too: 1.2-1.8x oneDNN's call at 1-32 rows (49152 x 576, 32000 x 2048)
    if out_features > MAX_COLUMNS:
        return 0
    if in_features % 32 == 0:
        return AMX_ROWS
    return TINY_ROWS if out_features * in_features <= TINY_WEIGHT else ROWS


def has_rows_pack(out_features: int, in_features: int, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether a weight of this shape and dtype gets a row pack in this process (the memory check counts it):
    `row_pack_for`'s rule, on this CPU."""
    ops = rows_module(dtype)
    return ops is not None and _row_limit_here(ops, out_features, in_features, dtype) > 0


def _row_limit_here(ops: ModuleType, out_features: int, in_features: int, dtype: torch.dtype) -> int:
    """`row_limit` on this CPU, as the library `ops` was built for it."""
    return row_limit(out_features, in_features, _amx(ops, dtype), dtype, _lanes(ops))


def _amx(ops: ModuleType, dtype: torch.dtype) -> bool:
    """Whether the library runs AMX tiles on this CPU (its bf16 product's; the float32 product's row limit was
    measured per kind of CPU too)."""
    amx = getattr(ops, "bf16_rows_amx", None)
    return amx is not None and bool(amx())


def _lanes(ops: ModuleType) -> int:
    """The float32 product's vector width in this library build (16 where it was built for AVX-512)."""
    lanes = getattr(ops, "f32_rows_lanes", None)
    return 16 if lanes is None else int(lanes())


def enabled_by_env() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0"


# False while the packed copies fit in memory only without the row packs (`allow_row_packs`, decided where a
# run's packing is: runner/step_options.py): oneDNN's products alone, as with the switch off.
_row_packs_fit = [True]


def allow_row_packs(allowed: bool) -> None:
    """Whether packs made from now on get row packs (the memory check's verdict for this run's model)."""
    _row_packs_fit[0] = allowed


def rows_module(dtype: torch.dtype = torch.bfloat16) -> ModuleType | None:
    """The native library if it has the small-row product of `dtype` (bfloat16: built for AVX512-BF16;
    float32: for AVX-512), the switch is on and the row packs fit (kept once found: it is looked up for every
    small product)."""
    if not enabled_by_env() or not _row_packs_fit[0] or dtype not in FUNCTIONS:
        return None
    if dtype in _found:
        return _found[dtype]
    ops = native_module()
    if ops is None or not hasattr(ops, FUNCTIONS[dtype]):
        return None
    _found[dtype] = ops
    return ops


_found: dict[torch.dtype, ModuleType] = {}


def pack_rows(weight: torch.Tensor) -> torch.Tensor:
    """`weight` `[N, K]` as `[ceil(N / 16), ceil(K / 2), 16, 2]`: block b, pair p holds columns 16b..16b+15's
    weights at k = 2p, 2p + 1 side by side (zero padded)."""
    out_features, in_features = weight.shape
    blocks, pairs = -(-out_features // 16), -(-in_features // 2)
    padded = F.pad(weight, (0, pairs * 2 - in_features, 0, blocks * 16 - out_features))
    return padded.view(blocks, 16, pairs, 2).permute(0, 2, 1, 3).contiguous()


def pack_rows_f32(weight: torch.Tensor) -> torch.Tensor:
    """`weight` `[N, K]` as `[ceil(N / 16), K, 16]`: block b holds columns 16b..16b+15's weights at each k
    side by side (zero padded)."""
    out_features, in_features = weight.shape
    blocks = -(-out_features // 16)
    padded = F.pad(weight, (0, 0, 0, blocks * 16 - out_features))
    return padded.view(blocks, 16, in_features).permute(0, 2, 1).contiguous()


def row_pack_for(pack: RowPacked, dtype: torch.dtype, rows: int) -> torch.Tensor | None:
    """`pack`'s row pack (made on first use) if a product of `rows` rows of `dtype` runs natively, else None."""
    packed_dtype = pack.packed.dtype
    limit = pack.row_limit
    if limit is None:  # decided once per pack: the switch is read when a pack first serves a product
        out_features, in_features = pack.packed.shape
        ops = rows_module(packed_dtype)
        limit = pack.row_limit = (
            0 if ops is None else _row_limit_here(ops, out_features, in_features, packed_dtype)
        )
    if limit == 0 or dtype != packed_dtype or rows == 0 or rows > limit or dtype not in _found:
        return None
    if pack.rows_pack is None:
        dense = pack.packed.to_dense()
        pack.rows_pack = pack_rows(dense) if dtype == torch.bfloat16 else pack_rows_f32(dense)
    return pack.rows_pack


def rows_product(x: torch.Tensor, pack: RowPacked, bias: torch.Tensor | None) -> torch.Tensor | None:
    """`x @ W.T + bias` for a bfloat16 or float32 `x` of few rows through the native loop, or None where
    oneDNN's product runs instead (more rows than the weight's limit, no native product, another dtype)."""
    in_features = x.shape[-1] if x.dim() else 0
    rows = x.numel() // in_features if in_features else 0
    rows_pack = row_pack_for(pack, x.dtype, rows)
    if rows_pack is None:
        return None
    out: torch.Tensor = getattr(_found[x.dtype], FUNCTIONS[x.dtype])(x, rows_pack, bias, pack.packed.shape[0])
    return out
