"""Compatibility attributes: the public attributes of transformers' built-in `ContinuousBatchingManager`,
as views onto this manager's own state, so code written against the built-in runs unchanged.

| attribute | the built-in's meaning | here |
|---|---|---|
| `manager.logit_processor` | the logits processors built from the generation config; `.clear()` drops them all | `LogitProcessorView`: the engine's processing stages; `.clear()` empties them |
| `manager.batch_processor` | the step driver of the running session (None before `start()` and after `stop()`); `.cache`, `.has_pending_requests()` | `BatchProcessorView` over the engine |
| `manager.current_batch` | steps run in this session | the loop's step count, reset at `start()` |
| `manager.output_router.output_queue` | the shared `queue.Queue` of outputs no handler or iterator claimed | `SharedQueueView` over the result router's shared queue |

Nothing here is transformers' code: each view is written against our engine, manager and router.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator
from typing import Protocol

from ..engine.engine import Engine
from ..requests import GenerationOutput
from .delivery.results import ResultRouter
from .loop import ManagerLoop
from .state import ManagerState


class LogitProcessorView:
    """The processing stages (`sampling/logits/processors.py`) of one engine, as a read-only sequence of names."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def __len__(self) -> int:
        return len(self._engine.processor_stage_names())

    def __iter__(self) -> Iterator[str]:
        return iter(self._engine.processor_stage_names())

    @property
    def do_processing(self) -> bool:
        """True when some stage exists (the built-in's flag of the same name)."""
        return bool(self._engine.processor_stage_names())

    def clear(self) -> None:
        """Drop every processor: later requests see the raw logits (greedy stays argmax, sampling draws
        from the unprocessed distribution). Call it before submitting requests."""
        self._engine.clear_logits_processors()

    def __repr__(self) -> str:
        return f"LogitProcessorView({list(self)})"


class KVCacheView:
    """What the built-in's paged cache exposes publicly, read from the engine."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    @property
    def num_blocks(self) -> int:
        return self._engine.num_total_pages

    @property
    def block_size(self) -> int:
        return self._engine.settings.cache.page_size

    @property
    def num_groups(self) -> int:
        return len(self._engine.settings.cache.kv_groups)

    @property
    def allow_block_sharing(self) -> bool:
        # The config's flag; here it is also whether sharing runs (`use_prefix_sharing`).
        return self._engine.settings.cache.sharing

    @property
    def use_prefix_sharing(self) -> bool:
        return self._engine.settings.cache.sharing

    def compute_free_capacity(self, relative: bool = True) -> int | float:
        """Free pages, as a fraction of all pages (`relative`) or a count."""
        total = self._engine.num_total_pages
        free = total - self._engine.num_used_pages
        return free / total if relative else free


class BatchProcessorView:
    """The running session's step driver: its cache and whether requests are pending."""

    def __init__(self, engine: Engine, num_incoming: Callable[[], int]) -> None:
        self._engine = engine
        self._num_incoming = num_incoming
        self.cache = KVCacheView(engine)

    def has_pending_requests(self) -> bool:
        """Requests submitted and not finished: queued for the loop, waiting or running in the engine."""
        return self._num_incoming() > 0 or self._engine.has_work()


class SharedQueueView:
    """The router's shared queue with `queue.Queue`'s methods (what `get_result()` reads)."""

    def __init__(self, router: ResultRouter) -> None:
        self._router = router

    def empty(self) -> bool:
        return self._router.num_shared() == 0

    def qsize(self) -> int:
        return self._router.num_shared()

    def get(self, block: bool = True, timeout: float | None = None) -> GenerationOutput:
        """Raises `queue.Empty` when nothing arrives (at once without `block`, else after `timeout`)."""
        output = self._router.get(None, timeout if block else 0.0)
        if output is None:
            raise queue.Empty
        return output

    def get_nowait(self) -> GenerationOutput:
        return self.get(block=False)

    def put(self, output: GenerationOutput, block: bool = True, timeout: float | None = None) -> None:
        """Put `output` back at the end of the shared queue (what the built-in's `get_result` does with an
        output of another request)."""
        self._router.requeue(output)


class OutputRouterView:
    def __init__(self, router: ResultRouter) -> None:
        self.output_queue = SharedQueueView(router)


class SessionDriver(Protocol):
    """Who holds the session's step driver (lifecycle.py's `Lifecycle`)."""

    batch_processor: BatchProcessorView | None


class BuiltinManagerAttributes:
    """The built-in manager's attributes above as properties of `ContinuousBatchingManager`, which keeps
    `_state` (the engine), `_loop` (the step count) and `_lifecycle` (its `batch_processor`: set at
    `start()`, cleared at `stop()` / destroy)."""

    _state: ManagerState
    _loop: ManagerLoop
    _lifecycle: SessionDriver

    @property
    def logit_processor(self) -> LogitProcessorView | None:
        """The engine's logits processors; `.clear()` drops them (None once destroyed)."""
        engine = self._state.engine
        return None if engine is None else LogitProcessorView(engine)

    @property
    def batch_processor(self) -> BatchProcessorView | None:
        """The session's step driver (`.cache`, `.has_pending_requests()`): None before `start()` and
        after `stop()` (unless kept for the next session), as in the built-in manager."""
        return self._lifecycle.batch_processor

    @property
    def current_batch(self) -> int:
        """Steps run since the last `start()`."""
        return self._loop.steps_this_session
