"""CUDA graphs of whole steps (`use_cuda_graph=True`), keyed by padded shapes, kept in an LRU cache.

A step's shapes are padded to buckets so that graphs repeat: the query length (tokens of the step) up
to a multiple of `q_padding_interval_size`, the KV length (longest request) up to a multiple of
`kv_padding_interval_size`. Each bucket (`GraphKey`) owns static input buffers (`StaticStep`) that every
replay reads; a step is copied into them, then the graph replays. Padding is inert:

- padded query tokens belong to no sequence (`cu_seqlens_q` repeats the real total), write their K/V to
  the cache's scratch page (outside every pool: no request's page), and their logits are never read;
- padded rows of the decode fast path have `cache_seqlens = 0` and a block table of the scratch page;
- block-table columns past a request's pages hold the scratch page and lie past its `seqused_k`.

Graphs replay static-shape kernels, so they run the paged flash backends only (`step_options.py`).
At most `max_cached_graphs` graphs live; the least recently used is dropped (its memory returns to the
shared pool). Without CUDA (tests) the same static steps run eagerly, so padding is testable on CPU.
With `use_async_batching`, each bucket has two buffer sets used alternately (`async_batching.py`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypedDict

import torch

from ...attention.metadata import AttentionMetadata, DecodeFastPath, GroupMetadata
from ...invariants import present
from .async_batching import BufferTurns
from .compiling import DECODE, VARLEN
from .model_call import call_model

if TYPE_CHECKING:
    from ...memory.kv_cache import PagedKVCache
    from ..packing import BatchPacker, PackedStep
    from ..step_options import StepOptions
    from .compiling import PathForwards

# The presets behind `q_padding_interval_size=0` / `kv_padding_interval_size=0`.
DEFAULT_Q_INTERVAL = 64
DEFAULT_KV_INTERVAL = 16384


def padded_length(length: int, interval: int) -> int:
    """`length` rounded up to a multiple of `interval` (at least one interval)."""
    return max(1, -(-length // interval)) * interval


@dataclass(frozen=True)
class GraphKey:
    path: str  # VARLEN, or DECODE (the decode fast path)
    q_len: int  # padded query tokens (= rows)
    kv_len: int  # padded longest KV (varlen path); 0 on the decode fast path (its table width is fixed)
    buffer: int = 0  # which of the async double buffers


class LRUCache:
    """At most `capacity` entries; `get` refreshes an entry, `put` drops the least recently used."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity={capacity} must be >= 1")
        self.capacity = capacity
        self._entries: OrderedDict[Any, Any] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def ordered_keys(self) -> list:
        """Least recently used first."""
        return list(self._entries)

    def values(self) -> list:
        return list(self._entries.values())

    def get(self, key: Any) -> Any | None:
        if key not in self._entries:
            return None
        self._entries.move_to_end(key)
        return self._entries[key]

    def put(self, key: Any, value: Any) -> list[Any]:
        """Insert `value`; returns the evicted values (oldest first)."""
        self._entries[key] = value
        self._entries.move_to_end(key)
        evicted = []
        while len(self._entries) > self.capacity:
            evicted.append(self._entries.popitem(last=False)[1])
        return evicted


class _TensorOptions(TypedDict):
    """The `torch.zeros` keywords of the static buffers."""

    dtype: torch.dtype
    device: torch.device


class StaticStep:
    """The fixed-shape inputs of one graph; `fill` copies a packed step in and pads the rest."""

    def __init__(self, key: GraphKey, cache: PagedKVCache, max_blocks: int, device: torch.device) -> None:
        q, self.key, self.cache = key.q_len, key, cache
        i32 = _TensorOptions(dtype=torch.int32, device=device)
        i64 = _TensorOptions(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(1, q, **i64)
        self.position_ids = torch.zeros(1, q, **i64)
        self.logits_indices = torch.zeros(q, **i64)
        width = key.kv_len // cache.page_size
        groups = [
            GroupMetadata(
                spec.sliding_window,
                torch.zeros(q, **i64),
                [],
                [],
                torch.zeros(q, width, **i32),
                spec.attention_chunk_size,
                spec.latent,
            )
            for spec in cache.groups
        ]
        fast = None
        if key.path == DECODE:
            fast = DecodeFastPath(torch.zeros(q, max_blocks, **i32), torch.zeros(q, **i32))
        self.metadata = AttentionMetadata(
            cache=cache,
            groups=groups,
            cu_seqlens_q=torch.zeros(q + 1, **i32),
            seq_lens_k=torch.zeros(q, **i32),
            max_seqlen_q=q,
            max_seqlen_k=key.kv_len if key.path == VARLEN else max_blocks * cache.page_size,
            cu_seqlens_k=torch.zeros(q + 1, **i32),
            decode_fast_path=fast,
            position_ids=self.position_ids[0],  # filled below with the step's
        )

    def fill(self, step: PackedStep) -> None:
        m, source = self.metadata, step.metadata
        num_rows = source.seq_lens_k.numel()
        _fill(self.input_ids[0], step.input_ids[0], 0)
        _fill(self.position_ids[0], step.position_ids[0], 0)
        _fill(self.logits_indices, step.logits_indices, 0)
        _fill(m.cu_seqlens_q, source.cu_seqlens_q, source.cu_seqlens_q[num_rows])  # empty padded sequences
        _fill(m.seq_lens_k, source.seq_lens_k, 0)
        static_cu_k = present(m.cu_seqlens_k, "a static step has cu_seqlens_k")
        real_cu_k = present(source.cu_seqlens_k, "a packed step has cu_seqlens_k")
        _fill(static_cu_k, real_cu_k, real_cu_k[num_rows])
        for g, (static, real) in enumerate(zip(m.groups, source.groups, strict=True)):
            scratch = self.cache.scratch_page_id(g)
            _fill(static.slot_mapping, real.slot_mapping, scratch * self.cache.page_size)
            if m.decode_fast_path is None:
                static.block_table.fill_(scratch)
                static.block_table[:num_rows, : real.block_table.shape[1]] = real.block_table
        if m.decode_fast_path is not None:
            fast = m.decode_fast_path
            real_fast = present(source.decode_fast_path, "a decode graph's step has the decode fast path")
            fast.block_table.fill_(self.cache.scratch_page_id(0))
            fast.block_table[:num_rows] = real_fast.block_table
            _fill(fast.cache_seqlens, real_fast.cache_seqlens, 0)


def _fill(static: torch.Tensor, real: torch.Tensor, pad: torch.Tensor | int) -> None:
    """Copy `real` into the front of `static` and `pad` (a value or a 0-d tensor) into the rest."""
    n = real.shape[0]
    static[:n].copy_(real)
    if n < static.shape[0]:
        if isinstance(pad, torch.Tensor):
            static[n:].copy_(pad.expand(static.shape[0] - n))
        else:
            static[n:].fill_(pad)


@dataclass
class GraphEntry:
    static: StaticStep
    graph: Any = None  # torch.cuda.CUDAGraph once captured
    logits: torch.Tensor | None = None  # [q_len, vocab] float32: the graph's output buffer
    replays: int = field(default=0)


class GraphSteps:
    """Runs steps through cached graphs (CUDA), or through the same static buffers eagerly (`capture=False`)."""

    def __init__(
        self,
        forward_for: Callable[[str], Callable],
        cache: PagedKVCache,
        options: StepOptions,
        device: torch.device,
        capture: bool,
    ) -> None:
        self.forward_for = forward_for
        self.cache_tensors = cache
        self.options = options
        self.device = device
        self.capture = capture
        self.graphs = LRUCache(options.max_cached_graphs)
        self.captures = 0
        self.turns = BufferTurns(device, enabled=options.async_batching and capture)
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self._no_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)

    def covers(self, path: str) -> bool:
        varlen, decode = self.options.cuda_graphs
        return decode if path == DECODE else varlen

    def key_for(self, step: PackedStep, path: str, buffer: int = 0) -> GraphKey:
        q_interval = self.options.q_padding_interval_size or DEFAULT_Q_INTERVAL
        q_len = padded_length(step.input_ids.shape[1], q_interval)
        if path == DECODE:
            return GraphKey(DECODE, q_len, 0, buffer)
        kv_interval = self.options.kv_padding_interval_size or DEFAULT_KV_INTERVAL
        kv_len = padded_length(step.metadata.max_seqlen_k, kv_interval)
        return GraphKey(VARLEN, q_len, padded_length(kv_len, self.cache_tensors.page_size), buffer)

    def run(self, step: PackedStep, path: str) -> torch.Tensor:
        """Logits `[q_len, vocab]` (float32) of the padded step; rows past the step's samples are padding."""
        key = self.key_for(step, path, self.turns.next_buffer())
        entry = self.graphs.get(key)
        if entry is None:
            entry = GraphEntry(
                StaticStep(key, self.cache_tensors, self.options.max_blocks_per_request, self.device)
            )
            self.graphs.put(key, entry)  # evicted graphs are freed with their entries
        with self.turns.filling(key.buffer):
            entry.static.fill(step)
        if not self.capture:
            entry.replays += 1
            return self._forward(entry.static, path)
        with self.turns.computing(key.buffer):
            if entry.graph is None:
                self._capture(entry, path)
            entry.graph.replay()
        entry.replays += 1
        return present(entry.logits, "a captured graph has its output buffer")

    def _forward(self, static: StaticStep, path: str) -> torch.Tensor:
        return call_model(
            self.forward_for(path),
            static.input_ids,
            static.position_ids,
            self._no_mask,
            static.logits_indices,
            static.metadata,
            self.options.select_logit_rows,
        ).float()

    def _capture(self, entry: GraphEntry, path: str) -> None:
        # One eager run on a side stream first (lazy init, autotuning), as CUDA graph capture requires;
        # it computes exactly what the replay computes (same inputs, same K/V slots), so it is harmless.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._forward(entry.static, path)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            entry.logits = self._forward(entry.static, path)
        entry.graph = graph
        self.captures += 1


def make_graph_steps(
    model: Any, packer: BatchPacker, options: StepOptions, forwards: PathForwards
) -> GraphSteps | None:
    """The runner's graph steps, when graphs are on (CUDA only: `config.continuous_batching.resolve_device_options`)."""
    if not any(options.cuda_graphs) or packer.rope_rule is not None:
        # A dynamic rotary embedding's frequency sets change from step to step (runner/request_rotary.py).
        return None
    return GraphSteps(forwards, packer.cache, options, packer.device, capture=packer.device.type == "cuda")
