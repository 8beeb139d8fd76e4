"""One packed step built like the engine's, for kernel and packer tests: a `PagedKVCache` with random
contents, requests on shuffled non-contiguous pages, and the `BatchPacker`'s metadata."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from transformers_cb.attention.metadata import AttentionMetadata
from transformers_cb.kv.layer_groups import CHUNKED_ATTENTION, SLIDING_ATTENTION, KVGroupSpec
from transformers_cb.memory.kv_cache import PagedKVCache
from transformers_cb.requests import PageList, Request
from transformers_cb.runner.packing import BatchPacker
from transformers_cb.scheduler.step_plan import ScheduledRequest, StepPlan


@dataclass
class KernelStep:
    """One random packed step: a cache with random contents, its requests and the packer's metadata.

    `packed_rows[i]` is the index (into `seqs`) of the request at packed position `i`;
    `query`/`key`/`value` are in packed order.
    """

    cache: PagedKVCache
    metadata: AttentionMetadata
    requests: list[Request]
    seqs: list[tuple[int, int]]  # (past_len, q_len) per request, in submission order
    packed_order: list[int]
    query: torch.Tensor  # [1, H, T, D]
    key: torch.Tensor  # [1, Hkv, T, D]
    value: torch.Tensor
    page_size: int
    scale: float
    initial_keys: torch.Tensor = field(repr=False, default=None)
    # Every page each request's tokens were written to (a sliding request has dropped the first ones).
    all_page_ids: list[list[int]] = field(default_factory=list)
    sliding_window: int | None = None
    chunk_size: int | None = None  # the layer's attention chunk (a chunked group)

    def slots(self, request_index: int, length: int) -> torch.Tensor:
        """Cache slots of tokens [0, length) of request `request_index`, from its page ids."""
        positions = torch.arange(length)
        pages = torch.tensor(self.all_page_ids[request_index])[positions // self.page_size]
        return pages * self.page_size + positions % self.page_size


def build_kernel_step(
    seqs: Sequence[tuple[int, int]],
    page_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    spare_pages: int = 3,
    sliding_window: int | None = None,
    native: bool = False,
    chunk_size: int | None = None,
    kv_dtype: torch.dtype | None = None,
) -> KernelStep:
    """Requests with (past_len, q_len) each, on shuffled non-contiguous pages, packed by `BatchPacker`.

    Every request's prompt tokens are unique to it, so the packed order is read back from `input_ids`.
    With `sliding_window`, the layer is in a sliding group: each request holds only the pages from its
    window on (as `SlidingWindowPolicy.trim` leaves them) in a block-table ring just wide enough.
    With `chunk_size`, the layer is in a chunked group: each request holds only the pages from its current
    attention chunk on (as `ChunkedAttentionPolicy.trim` leaves them), in a ring as wide as a window's.
    With `native`, the packer hands the decodes and short chunks to the native CPU kernel.
    `kv_dtype`: the cache's storage dtype when not `dtype` (int8: random rows quantized, with their scales).
    """
    generator = torch.Generator().manual_seed(seed)
    num_pages_each = [math.ceil((past + q) / page_size) for past, q in seqs]
    num_pages = sum(num_pages_each) + spare_pages
    groups = widths = None
    span = sliding_window if sliding_window is not None else chunk_size
    if sliding_window is not None:
        groups = [KVGroupSpec(SLIDING_ATTENTION, (0,), sliding_window)]
    elif chunk_size is not None:
        groups = [KVGroupSpec(CHUNKED_ATTENTION, (0,), attention_chunk_size=chunk_size)]
    if span is not None:
        max_q = max(q for _, q in seqs)
        widths = [min(max(num_pages_each), math.ceil((span - 1 + max_q) / page_size) + 1)]
    storage = kv_dtype or dtype
    cache = PagedKVCache(
        1, num_pages, page_size, num_kv_heads, head_dim, storage, torch.device("cpu"), groups
    )
    every_slot = torch.arange(cache.keys[0].shape[0])
    cache.write(
        0,
        every_slot,
        torch.randn(cache.keys[0].shape, generator=generator),
        torch.randn(cache.values[0].shape, generator=generator),
    )
    initial_keys = cache.keys[0].clone()
    permutation = torch.randperm(num_pages, generator=generator).tolist()
    requests, entries, all_page_ids, offset = [], [], [], 0
    for i, ((past, q), count) in enumerate(zip(seqs, num_pages_each, strict=True)):
        tokens = [1000 * (i + 1) + t for t in range(past + q)]  # unique per request
        request = Request(request_id=f"r{i}", prompt_ids=tokens, max_new_tokens=1)
        all_page_ids.append(permutation[offset : offset + count])
        first = 0
        if sliding_window is not None:
            first = max(0, past - sliding_window + 1) // page_size
        elif chunk_size is not None:
            first = past // chunk_size * chunk_size // page_size
        request.pages = [PageList(all_page_ids[-1][first:], first_page=first)]
        request.num_computed_tokens = past
        offset += count
        requests.append(request)
        entries.append(ScheduledRequest(request, past, q))
    packer = BatchPacker(cache, widths or max(num_pages_each), torch.device("cpu"), native=native)
    step = packer.pack(StepPlan(entries=entries))
    metadata = step.metadata
    # The packer reorders requests; recover the order from the (unique) token ids.
    cu = metadata.cu_seqlens_q.tolist()
    packed_order = [int(step.input_ids[0, cu[j]]) // 1000 - 1 for j in range(len(seqs))]
    total = sum(q for _, q in seqs)
    query = torch.randn(1, num_heads, total, head_dim, generator=generator).to(dtype)
    key = torch.randn(1, num_kv_heads, total, head_dim, generator=generator).to(dtype)
    value = torch.randn(1, num_kv_heads, total, head_dim, generator=generator).to(dtype)
    return KernelStep(
        cache=cache,
        metadata=metadata,
        requests=requests,
        seqs=list(seqs),
        packed_order=packed_order,
        query=query,
        key=key,
        value=value,
        page_size=page_size,
        scale=head_dim**-0.5,
        initial_keys=initial_keys,
        all_page_ids=all_page_ids,
        sliding_window=sliding_window,
        chunk_size=chunk_size,
    )
