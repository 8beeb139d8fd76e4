"""Observability: `ManagerStats` snapshots and a recent-throughput window.

`snapshot()` builds a `ManagerStats` from the manager's own counts and from `EngineFigures`, the figures
read from the engine; `engine_figures()` is the one place that reaches into the engine for them.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..requests import RequestStatus

if TYPE_CHECKING:  # engine/scheduler.py imports `RecomputeCounter` from here
    from ..engine.engine import Engine
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


@dataclass(frozen=True)
class EngineFigures:
    """What `ManagerStats` reads from the engine at one moment (all zero once the engine is released)."""

    waiting: int = 0  # requests in the scheduler's waiting queue
    running: int = 0
    preemptions: int = 0
    pages_in_use: int = 0
    pages_total: int = 0
    pages_in_use_by_group: dict[str, int] = field(default_factory=dict)
    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefix_cache_hit_rate: float = 0.0
    prefix_cache_hit_tokens: int = 0
    prefix_cache_pages: int = 0
    prefix_cache_evictions: int = 0
    recomputed_tokens: int = 0
    swapped_out: int = 0
    swap_out_pages: int = 0
    swap_in_pages: int = 0


def engine_figures(engine: Engine | None) -> EngineFigures:
    """Read `EngineFigures` from `engine`: the scheduler's queues and page manager, the cache, the
    counters and the CPU offload tier (an `Engine.snapshot()` would make this one call)."""
    if engine is None:
        return EngineFigures()
    scheduler, pages, offload = engine.scheduler, engine.scheduler.allocator, engine.offload
    prefix_stats = pages.prefix.stats if pages.prefix is not None else None
    return EngineFigures(
        waiting=len(scheduler.waiting),
        running=len(scheduler.running),
        preemptions=scheduler.num_preemptions,
        pages_in_use=engine.cache.num_used_pages,
        pages_total=engine.cache.num_total_pages,
        pages_in_use_by_group=pages.pages_in_use(),
        prefill_tokens=engine.counters.prefill_tokens,
        decode_tokens=engine.counters.decode_tokens,
        prefix_cache_hit_rate=prefix_stats.hit_rate if prefix_stats is not None else 0.0,
        prefix_cache_hit_tokens=prefix_stats.hit_tokens if prefix_stats is not None else 0,
        prefix_cache_pages=pages.num_cached_pages,
        prefix_cache_evictions=pages.num_evictions,
        recomputed_tokens=scheduler.recomputed.total,
        swapped_out=offload.num_swapped_out if offload is not None else 0,
        swap_out_pages=offload.swap_out_pages if offload is not None else 0,
        swap_in_pages=offload.swap_in_pages if offload is not None else 0,
    )


def snapshot(state: ManagerState, throughput: ThroughputWindow) -> ManagerStats:
    """The manager's `ManagerStats` now (`state.lock` held by the caller)."""
    engine = engine_figures(state.engine)
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
        prefill_tokens=engine.prefill_tokens,
        decode_tokens=engine.decode_tokens,
        prefix_cache_hit_rate=engine.prefix_cache_hit_rate,
        prefix_cache_hit_tokens=engine.prefix_cache_hit_tokens,
        prefix_cache_pages=engine.prefix_cache_pages,
        prefix_cache_evictions=engine.prefix_cache_evictions,
        tokens_per_second=throughput.rate(),
        delivered_tokens=throughput.total,
        recomputed_tokens=engine.recomputed_tokens,
        swapped_out=engine.swapped_out,
        swap_out_pages=engine.swap_out_pages,
        swap_in_pages=engine.swap_in_pages,
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


class RecomputeCounter:
    """Tokens a preempted request runs again because its KV was dropped (recompute, not CPU offload).

    Counted when they run, so that pages a returning request finds in the prefix cache do not count.
    """

    def __init__(self) -> None:
        self.total = 0
        self.pending: dict[str, int] = {}  # request id -> end of what it had computed when last dropped

    def dropped(self, request_id: str, num_computed_tokens: int) -> None:
        until = max(num_computed_tokens, self.pending.get(request_id, 0))
        if until:
            self.pending[request_id] = until

    def ran(self, request_id: str, start: int, end: int) -> None:
        """The request computed tokens [start, end) in a step."""
        until = self.pending.get(request_id)
        if until is None:
            return
        self.total += max(0, min(end, until) - start)
        if end >= until:
            del self.pending[request_id]

    def forget(self, request_id: str) -> None:
        self.pending.pop(request_id, None)
