"""Microbenchmark of the products over GGUF blocks (runner/products/quantized_linear.py) against torch's float ones.

For the real model's shapes (SmolLM2-135M: 576 -> 1536 for gate/up, 1536 -> 576 for down, an 8192-column
slice of the 49152-column LM head), random weights quantized by the `gguf` package, it times per row count:
the native product reading the blocks (`quant_matmul`), `F.linear` on the float weight held resident (what a
float model runs), and the dequantized-tile path (`quant_dequantize` + `F.linear`, what `quantized_product`
runs beyond `DIRECT_MAX_ROWS`), for float32 and bfloat16 inputs; for a bfloat16 x and a 4-bit type also the
lane product (the blocks repacked over lanes, `quant_lanes_pack`). One process, one thread by default, a few
seconds: `OMP_NUM_THREADS=1 python benchmarks/quantized_products.py` (docs/quantization.md has a table).
`--copies N` cycles through N copies of each weight, so that the products read their weights from memory as a
model's decode step does, not from the cache.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from transformers_cb.attention.native.kernel import ensure_native_module

SHAPES = ((1536, 576), (576, 1536), (8192, 576))
ROWS = (1, 4, 8, 16, 32, 128)


def best_us(call: Callable[[], object], seconds: float = 0.1) -> float:
    """Mean microseconds of `call` over `seconds` (after one warm-up call)."""
    call()
    start, count = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        call()
        count += 1
    return (time.perf_counter() - start) / count * 1e6


DTYPES = (torch.float32, torch.bfloat16)


LANES = 100  # a lane layout's type: LANES + the GGUF type (runner/products/quantized_linear.py)


def cycling(items: list) -> Callable[[], object]:
    """The next of `items` at each call (copies of a weight, so that each product reads it from memory)."""
    state = {"i": 0}

    def next_item() -> object:
        state["i"] = (state["i"] + 1) % len(items)
        return items[state["i"]]

    return next_item


def row_cells(
    ops, blocks: list[torch.Tensor], qtype: int, weight: torch.Tensor, rows: int, dtype: torch.dtype
) -> str:
    """One dtype's timings at `rows` rows (the lane product's too where it applies)."""
    x = torch.randn(rows, weight.shape[1]).to(dtype)
    block, floats = cycling(blocks), cycling([weight.to(dtype) for _ in blocks])
    native = best_us(lambda: ops.quant_matmul(x, block(), qtype))
    plain = best_us(lambda: F.linear(x, floats()))
    tiles = best_us(lambda: F.linear(x, ops.quant_dequantize(block(), qtype, dtype)))
    cells = f"{str(dtype)[6:]:>8}: {native:8.0f} {plain:8.0f} {tiles:8.0f}"
    if dtype == torch.bfloat16 and qtype in (2, 3) and ops.quant_lanes_available():
        lane = cycling([ops.quant_lanes_pack(b, qtype) for b in blocks])
        cells += f" {best_us(lambda: ops.quant_matmul(x, lane(), LANES + qtype)):8.0f}"
    return cells


def main() -> None:
    import gguf

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quant", choices=("Q4_0", "Q4_1", "Q8_0"), nargs="+", default=["Q4_1", "Q8_0"])
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    parser.add_argument("--copies", type=int, default=1, help="copies of each weight cycled through")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ops = ensure_native_module()
    if ops is None:
        raise SystemExit("the native library cannot be built here")
    print(
        f"threads={args.threads}, copies={args.copies}; microseconds per product: native blocks / F.linear"
        " float / dequantized tiles (/ lanes: bfloat16, 4-bit)"
    )
    for out_features, in_features in SHAPES:
        values = np.random.default_rng(0).standard_normal((out_features, in_features)).astype(np.float32)
        for name in args.quant:
            qtype = gguf.GGMLQuantizationType[name]
            blocks = torch.from_numpy(np.array(gguf.quants.quantize(values, qtype)))
            weight = torch.from_numpy(np.array(gguf.quants.dequantize(blocks.numpy(), qtype)))
            copies = [blocks.clone() for _ in range(args.copies)]
            for rows in args.rows:
                cells = [row_cells(ops, copies, int(qtype), weight, rows, dtype) for dtype in DTYPES]
                print(
                    f"{name} {out_features:>5}x{in_features:<5} rows={rows:<4}", " | ".join(cells), flush=True
                )


if __name__ == "__main__":
    main()
