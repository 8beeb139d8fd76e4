"""Microbenchmark of a prefill chunk's attention: the native kernel's query tiles against the same kernel token by
token and torch's SDPA (what a chunk over the short-chunk bound ran before, runner/call_groups.py).

One chunk of N tokens from position 0 of one row, causal, over a paged cache laid out in order. "per token":
the same call with the tokens in reverse order, so no two neighbours form a tile. Milliseconds per call (one
layer), mean after a warm-up, in one process: `python benchmarks/prefill_attention.py [--threads 2]`
(docs/design.md, "Query tiles", has the table).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from transformers_cb.attention.native.kernel import (
    ensure_native_module,
    native_paged_attention,
    vector_kernels,
)

# (query heads, KV heads, head size): the small benchmark model, SmolLM2-135M, an 8B-class layer.
SHAPES = ((8, 2, 64), (9, 3, 64), (32, 8, 128))
TOKENS = (128, 512, 1024, 2048)
PAGE = 16


def mean_ms(call: Callable[[], object], repeats: int) -> float:
    call()
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - start) / repeats * 1e3


def one_shape(
    heads: int, kv_heads: int, dim: int, tokens: int, dtype: torch.dtype
) -> tuple[float, float, float]:
    """(tiles, per token, SDPA) milliseconds of one chunk of `tokens` tokens."""
    gen = torch.Generator().manual_seed(0)
    pages = (tokens + PAGE - 1) // PAGE
    keys = torch.randn(pages * PAGE, kv_heads, dim, generator=gen).to(dtype)
    values = torch.randn(pages * PAGE, kv_heads, dim, generator=gen).to(dtype)
    table = torch.arange(pages, dtype=torch.int32).view(1, pages)
    query = torch.randn(tokens, heads, dim, generator=gen).to(dtype)
    rows, positions = torch.zeros(tokens, dtype=torch.long), torch.arange(tokens)
    out = torch.empty_like(query)
    repeats = max(2, int(2e8 // (tokens * tokens * heads * dim)))

    def native(order: torch.Tensor) -> Callable[[], None]:
        q, r, p = query[order], rows[order], positions[order]
        return lambda: native_paged_attention(
            q, keys, values, r, p, table, PAGE, dim**-0.5, None, None, None, out
        )

    tiles = mean_ms(native(torch.arange(tokens)), repeats)
    per_token = mean_ms(native(torch.arange(tokens).flip(0)), repeats)
    q = query.transpose(0, 1).unsqueeze(0)
    k, v = keys[:tokens].transpose(0, 1).unsqueeze(0), values[:tokens].transpose(0, 1).unsqueeze(0)
    sdpa = mean_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), repeats)
    return tiles, per_token, sdpa


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if ensure_native_module() is None or not vector_kernels():
        raise SystemExit("the native kernel's AVX-512 path is not built here")
    print(f"threads {torch.get_num_threads()}; ms per layer (tiles / per token / SDPA)")
    print("| heads | tokens | dtype | tiles | per token | SDPA | SDPA / tiles |")
    print("|---|---|---|---|---|---|---|")
    for dtype in (torch.bfloat16, torch.float32):
        for heads, kv_heads, dim in SHAPES:
            for tokens in TOKENS:
                tiles, per_token, sdpa = one_shape(heads, kv_heads, dim, tokens, dtype)
                name = str(dtype).removeprefix("torch.")
                print(
                    f"| {heads}/{kv_heads}x{dim} | {tokens} | {name} | {tiles:.2f} | {per_token:.2f} | "
                    f"{sdpa:.2f} | {sdpa / tiles:.2f} |"
                )


if __name__ == "__main__":
    main()
