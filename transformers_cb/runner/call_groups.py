"""Which of a step's rows share one attention call: the rules the packer (runner/packing.py) follows.

Decodes of close KV lengths share a padded call (`group_decodes`, within `decode_padding_bound(dtype)` of
their real work; float32 only); short prefill chunks join the native kernel's one call per layer
(`native_prefill_max_work(dtype)` (query, key) pairs at most), longer ones keep a call of their own, except
where the kernel's query tiles take every chunk (`native_takes_every_chunk`).
"""

from __future__ import annotations

import sys

import torch

from ..memory.kv_cache import CacheLayout

# A float32 decode group may do at most this much more attention work than its real KV lengths need.
DECODE_PADDING_BOUND = 1.25
# Prefill chunks with at most this many (query, key) pairs join the native kernel's single call: the
# kernel reads a request's keys once per query token, so it only beats a per-chunk SDPA call on short
# chunks (see docs/design.md, "The native CPU kernel"). bfloat16 / float16: SDPA's blocked kernel wins from
# ~128 tokens on one chunk, but a step of many short prompts pays a call per chunk and layer. float32: the
# AVX-512 kernel is 1.4x SDPA up to 512 tokens (issue 46).
NATIVE_PREFILL_MAX_WORK = 128 * 128
NATIVE_PREFILL_MAX_WORK_FP32 = 512 * 512


# Head sizes and query heads per KV head that the AVX-512 kernel and its query tiles take
# (attention/native/native_vec_source.py: `vec_for_group`, `tile_for`).
VECTOR_HEAD_DIMS = (64, 128)
VECTOR_MAX_GROUP = 8


def native_takes_every_chunk(layout: CacheLayout, group_size: int, vector_kernels: bool, amx: bool) -> bool:
    """Whether prefill chunks of any length (on AVX2: up to `native_chunk_max_work`) join the native call: where
    the vector kernel takes every layer's shape (plain K/V pages: no latent rows, no V of another size, no
    repeated heads), its query tiles (a chunk's tokens share each widened K/V block) beat SDPA at every length
    measured with AVX-512 (2-core AMD EPYC Zen 4, 8 heads on 2
    KV heads of 64: 512 tokens 2.0 ms against SDPA's 4.9, 2048 tokens 30 ms against 45, bf16 and fp32 alike;
    docs/design.md). Not for bfloat16 on a CPU with AMX, whose SDPA runs its products on AMX tiles, nor for
    float16 (no vector kernel)."""
    dtype = layout.dtype
    if not vector_kernels or dtype not in (torch.float32, torch.bfloat16) or (amx and dtype != torch.float32):
        return False
    plain = all(
        spec.latent is None and spec.value_dim is None and spec.kv_repeat == 1 and spec.index_dim is None
        for spec in layout.groups
    )
    head_dims = {layout.head_shape(g)[1] for g in range(len(layout.groups))}
    return plain and head_dims <= set(VECTOR_HEAD_DIMS) and 1 <= group_size <= VECTOR_MAX_GROUP


# On an AVX2-only CPU (the 8-lane kernels, AMD Zen 3, 2 threads) the query tiles beat SDPA up to 1024 tokens
# for heads of 64 (1.13-1.94x) but not at 2048 (0.99-1.16x), and for heads of 128 up to 512 tokens only
# (1.20-1.68x; 0.88-0.94x at 1024): longer chunks keep SDPA there (docs/design.md, "AVX2-only CPUs").
AVX2_CHUNK_MAX_WORK = 1024 * 1024
AVX2_WIDE_HEAD_CHUNK_MAX_WORK = 512 * 512


def native_chunk_max_work(layout: CacheLayout, group_size: int, lanes: int, amx: bool) -> int:
    """The (query, key) pairs up to which any prefill chunk joins the native call by the vector kernels' width
    (`vector_lanes()`): every chunk with AVX-512, the measured bounds with AVX2, 0 where the query tiles do not
    take the model's shape (`native_takes_every_chunk`)."""
    if not native_takes_every_chunk(layout, group_size, lanes > 0, amx):
        return 0
    if lanes >= 16:
        return sys.maxsize
    wide = any(layout.head_shape(g)[1] > 64 for g in range(len(layout.groups)))
    return AVX2_WIDE_HEAD_CHUNK_MAX_WORK if wide else AVX2_CHUNK_MAX_WORK


def native_prefill_max_work(dtype: torch.dtype) -> int:
    """The (query, key) pairs up to which a prefill chunk of a `dtype` cache joins the native call."""
    return NATIVE_PREFILL_MAX_WORK_FP32 if dtype == torch.float32 else NATIVE_PREFILL_MAX_WORK


def decode_padding_bound(dtype: torch.dtype) -> float:
    """How much padding a decode group may carry with KV of `dtype`. Only float32 pads: in bf16 / fp16
    the softmax over a key range padded with masked keys rounds differently from `generate()`'s
    exact-length attention, which flips greedy ties; decodes of equal KV length still share a call."""
    return DECODE_PADDING_BOUND if dtype == torch.float32 else 1.0


def group_decodes(kv_lens: list[int], bound: float = DECODE_PADDING_BOUND) -> list[tuple[int, int]]:
    """Split `kv_lens` into [start, end) runs with `len * max <= bound * sum` (descending lengths, except
    in a chunked group, where a decode reads its chunk's keys only: its run's max is then not its first)."""
    groups: list[tuple[int, int]] = []
    start, total, longest = 0, 0, 0
    for i, length in enumerate(kv_lens):
        if i > start and (i - start + 1) * max(longest, length) > bound * (total + length):
            groups.append((start, i))
            start, total, longest = i, 0, 0
        total += length
        longest = max(longest, length)
    if start < len(kv_lens):
        groups.append((start, len(kv_lens)))
    return groups
