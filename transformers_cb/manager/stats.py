"""Observability: `ManagerStats` snapshots and a recent-throughput window.

`snapshot()` builds a `ManagerStats` from the manager's own counts and the engine's `Engine.snapshot()`
(one call: the manager never reaches into the scheduler, the pages or the offload tier itself).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..engine.snapshot import EngineSnapshot
from ..requests import RequestStatus

if TYPE_CHECKING:
    from .state import ManagerState


@dataclass(frozen=True)
class ManagerStats:
    queued: int
    running: int
    finished: int
    failed: int
    cancelled: int
    preemptions: int
    pages_in_use: int
    pages_total: int
    prefill_tokens: int
    decode_tokens: int
    prefix_cache_hit_rate: (
        float  # tokens found cached / tokens to compute, over admissions (0 when sharing is off)
    )
    # Tokens handed to users: each streamed partial output's new token when it is published, and a
    # non-streaming request's tokens when it FINISHES. Tokens of failed or cancelled requests that no
    # output had delivered do not count (their final output still carries them).
    tokens_per_second: float  # delivered tokens over the last 10 s
    delivered_tokens: int = 0  # since creation
    # KV layer group name (e.g. "full_attention", "sliding_attention(window=4096)") -> pages in use.
    pages_in_use_by_group: dict[str, int] = field(default_factory=dict)
    prefix_cache_hit_tokens: int = 0  # prefill tokens skipped thanks to cached pages, since creation
    prefix_cache_pages: int = 0  # pages kept only for later hits (evictable), all groups
    prefix_cache_evictions: int = 0  # cached pages reallocated to other content, since creation
    # Preemption: tokens run again because their KV was dropped (prefix-cache hits excluded), and CPU
    # offload (docs/offload.md): requests swapped out to the host tier now, pages copied to it and back.
    recomputed_tokens: int = 0
    swapped_out: int = 0
    swap_out_pages: int = 0
    swap_in_pages: int = 0
    # torch.compile graphs built by the engine's steps (warm-up included): flat after the first steps of
    # each path when shapes are dynamic (docs/fast_paths.md, "Compiling the forward").
    compiled_graphs: int = 0
    # State layers (linear attention, Mamba, short convolutions; docs/state_layers.md): the per-request
    # state slots held by running requests, all of them, and one slot's bytes (0 without state layers).
    state_slots_in_use: int = 0
    state_slots_total: int = 0
    state_bytes_per_slot: int = 0
    # One token's KV bytes in every KV group (a multi-latent model: its latent, kv_lora_rank +
    # qk_rope_head_dim values per layer, not the decompressed K/V; docs/models.md).
    kv_bytes_per_token: int = 0
    # Packed products (docs/design.md, "Packed products"): bytes of the packed copies of the model's Linear
    # weights held now (0 when the engine runs plain products).
    packed_weight_bytes: int = 0
    # Images / videos / audio (docs/multimodal.md): items encoded and the encoder's time since creation (off
    # the decoder's forwards), and the embedding store's rows held now, of its capacity.
    media_items_encoded: int = 0
    media_encode_seconds: float = 0.0
    media_store_rows: int = 0
    media_store_capacity: int = 0
    # Speculative decoding (docs/speculative_decoding.md), since creation: draft tokens verified, accepted,
    # the steps that verified drafts and the tokens those steps appended.
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    speculation_steps: int = 0
    speculation_tokens: int = 0
    # Weight updates (docs/manager.md): the model's weight version now (0 at creation, one more per change),
    # and the requests ended ABORTED by a `pause(mode="abort")` since creation.
    weight_version: int = 0
    aborted: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / verified draft tokens (0.0 without speculation)."""
        return self.accepted_draft_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_speculation_step(self) -> float:
        """Tokens a request appended per step that verified its draft (1.0 would be no gain)."""
        return self.speculation_tokens / self.speculation_steps if self.speculation_steps else 0.0


def snapshot(state: ManagerState, throughput: ThroughputWindow) -> ManagerStats:
    """The manager's `ManagerStats` now (`state.lock` held by the caller)."""
    engine = state.engine.snapshot() if state.engine is not None else EngineSnapshot()
    counters, prefix = engine.counters, engine.prefix
    return ManagerStats(
        queued=len(state.incoming) + engine.waiting,
        running=engine.running,
        finished=state.counts[RequestStatus.FINISHED],
        failed=state.counts[RequestStatus.FAILED],
        cancelled=state.counts[RequestStatus.CANCELLED],
        preemptions=engine.preemptions,
        pages_in_use=engine.pages_in_use,
        pages_total=engine.pages_total,
        pages_in_use_by_group=engine.pages_in_use_by_group,
        prefill_tokens=counters.prefill_tokens,
        decode_tokens=counters.decode_tokens,
        prefix_cache_hit_rate=prefix.hit_rate,
        prefix_cache_hit_tokens=prefix.hit_tokens,
        prefix_cache_pages=engine.prefix_cache_pages,
        prefix_cache_evictions=engine.prefix_cache_evictions,
        tokens_per_second=throughput.rate(),
        delivered_tokens=throughput.total,
        recomputed_tokens=engine.recomputed_tokens,
        swapped_out=engine.swapped_out,
        swap_out_pages=engine.swap_out_pages,
        swap_in_pages=engine.swap_in_pages,
        compiled_graphs=engine.compiled_graphs,
        state_slots_in_use=engine.state_slots_in_use,
        state_slots_total=engine.state_slots_total,
        state_bytes_per_slot=engine.state_bytes_per_slot,
        kv_bytes_per_token=engine.kv_bytes_per_token,
        packed_weight_bytes=engine.packed_weight_bytes,
        media_items_encoded=engine.media_items_encoded,
        media_encode_seconds=engine.media_encode_seconds,
        media_store_rows=engine.media_store_rows,
        media_store_capacity=engine.media_store_capacity,
        draft_tokens=engine.speculation.drafted,
        accepted_draft_tokens=engine.speculation.accepted,
        speculation_steps=engine.speculation.steps,
        speculation_tokens=engine.speculation.emitted,
        weight_version=engine.weight_version,
        aborted=state.counts[RequestStatus.ABORTED],
    )


class ThroughputWindow:
    """Delivered tokens per second over the last `window_s` seconds, and their total."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._events: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()
        self.total = 0

    def add(self, num_tokens: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            self.total += num_tokens
            self._events.append((now, num_tokens))
            self._trim(now)

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        with self._lock:
            self._trim(now)
            if not self._events:
                return 0.0
            span = max(now - self._events[0][0], 1e-3)
            return sum(n for _, n in self._events) / span

    def _trim(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self.window_s:
            self._events.popleft()
