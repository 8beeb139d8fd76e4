"""`ContinuousBatchingManager`: a background thread that runs the engine while requests arrive.

This module is the caller-side half: lifecycle, submissions, results. The thread-side half (the loop
around `Engine.step()`) is `manager_loop.ManagerLoop`; results flow out through `results.ResultRouter`.
See docs/manager.md for the contract.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel

from ..attention.selection import paged_attention
from ..config.continuous_batching import ContinuousBatchingConfig
from ..config.interop import as_cb_config, as_workload_hints
from ..engine.engine import Engine
from ..requests import GenerationOutput, RequestStatus
from .channels import async_channel, blocking_channel
from .loop import (
    CACHED_MANAGER_ATTR,
    HARD_STOP_ERROR,
    NOT_RUN_ERROR,
    BackgroundThreadStatus,
)
from .results import Deliver
from .stats import ManagerStats
from .submissions import ManagerSubmissions
from .threads import ThreadSettings

logger = logging.getLogger(__name__)

# destroy() lets queued and running requests finish for this long, then hard-stops them.
DESTROY_GRACE_S = 10.0
# After a hard stop, the thread ends at the next step boundary; a step that takes longer is stuck.
HARD_STOP_JOIN_S = 60.0


class ContinuousBatchingManager(ManagerSubmissions):
    """Serve requests with continuous batching from a background thread.

    Create it with `model.init_continuous_batching(...)` or
    `model.continuous_batching_context_manager(...)`. See docs/manager.md.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        generation_config: GenerationConfig | None = None,
        continuous_batching_config: ContinuousBatchingConfig | Any | None = None,
        workload_hints: Any | None = None,
        tokenizer: Any | None = None,
        logits_processor: Any | None = None,
    ) -> None:
        self.model = model
        hints = as_workload_hints(workload_hints)
        self.engine: Engine | None = Engine(
            model,
            generation_config,
            as_cb_config(continuous_batching_config),
            tokenizer,
            logits_processor,
            workload=hints.workload() if hints is not None else None,
        )
        self.max_queue_size = self.engine.cb_config.max_queue_size
        self._init_loop_state()
        self._pause_holders = threading.local()

    # -- lifecycle ---------------------------------------------------------------------
    @property
    def background_thread_status(self) -> BackgroundThreadStatus:
        """`.fatal_error`: None while the thread lives (or has not started), the exception once it died."""
        return self._thread_status

    def start(self) -> None:
        """Start the background thread (again after `stop()`). Raises `RuntimeError` after `destroy()`,
        `ManagerDeadError` (a `RuntimeError`) if the thread died."""
        thread = self._thread
        if (
            thread is not None
            and thread.is_alive()
            and self._stop_requested
            and thread is not threading.current_thread()
        ):
            thread.join()  # a `stop(block=False)` is under way: let it end, then start a new session
        with self._lock:
            if self._destroyed or self._release_on_exit:
                raise RuntimeError("this ContinuousBatchingManager was destroyed and cannot be restarted")
            if self.is_running():
                logger.warning("ContinuousBatchingManager.start(): already running")
                return
            self._router.check_alive()  # a dead thread's manager cannot be restarted: ManagerDeadError
            self._accepting, self._stop_requested, self._hard_stop = True, False, False
            self._router.set_closed(False)
            settings = ThreadSettings.capture()
            self._thread = threading.Thread(
                target=self._run, args=(settings,), name="transformers-cb", daemon=True
            )
            self._thread.start()

    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def is_destroyed(self) -> bool:
        return self._destroyed

    @property
    def warmed_up(self) -> bool:
        return self.engine is not None and self.engine.warmed_up

    def warmup(self) -> None:
        """Run a throw-away prefill and decode step now, so the first request does not pay for
        first-call costs. Once per manager; only before `start()` (a running manager skips it)."""
        engine = self.engine
        if engine is None:
            raise RuntimeError("this ContinuousBatchingManager was destroyed")
        if engine.warmed_up:
            return
        if self.is_running():
            logger.warning("ContinuousBatchingManager.warmup(): skipped, the manager is already running")
            return
        with paged_attention(self.model, engine.step_options.attn_implementation), torch.inference_mode():
            engine.warmup()

    def stop(
        self,
        block: bool = True,
        timeout: float | None = None,
        keep_for_next_session: bool = False,
        hard_stop: bool = False,
    ) -> None:
        """Refuse new submissions and end the thread: after finishing queued and active requests
        (default), or at once with every unfinished request failed by a `RuntimeError` (`hard_stop`).

        With `block`, wait up to `timeout` seconds (None: no limit) for the thread (see `join`). With
        `keep_for_next_session`, the manager is cached on the model and the next
        `init_continuous_batching` / context returns it.

        On a manager that is not running, every request still queued ends at once (FAILED, with the
        reason): nothing would ever run it; with `keep_for_next_session` they wait for the next
        session instead. Raises `RuntimeError` for a blocking graceful stop from inside `pause()` (the
        paused loop could never finish the queue)."""
        holds_pause = getattr(self._pause_holders, "count", 0) > 0
        if holds_pause and block and not hard_stop and self.is_running():
            raise RuntimeError(
                "stop() from inside pause() would wait forever: the loop is paused and cannot finish the "
                "queue; leave the pause first, or use hard_stop=True / block=False"
            )
        if keep_for_next_session:
            setattr(self.model, CACHED_MANAGER_ATTR, self)
        with self._lock:
            self._accepting = False
            self._stop_requested = True
            self._hard_stop = self._hard_stop or hard_stop
            self._lock.notify_all()
        if not self.is_running():
            if hard_stop or not keep_for_next_session:
                self._fail_everything(HARD_STOP_ERROR if hard_stop else NOT_RUN_ERROR)
            self._router.set_closed(True)
            return
        if block:
            self.join(time.perf_counter(), timeout)

    def join(self, stop_trigger_time: float, timeout: float | None = None) -> None:
        """Wait up to `timeout` seconds (None: no limit) for the thread to end after a stop requested at
        `stop_trigger_time` (`time.perf_counter()`); logs how long it took, or that it is still running."""
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return
        thread.join(timeout)
        if thread.is_alive():
            logger.warning("the continuous batching thread did not end within the timeout (%s s)", timeout)
        else:
            logger.info(
                "continuous batching thread ended %.2f s after stop", time.perf_counter() - stop_trigger_time
            )

    def destroy(self, block: bool = True, grace_period: float | None = DESTROY_GRACE_S) -> None:
        """Stop and release the cache; the manager cannot restart afterwards. Idempotent.

        Queued and running requests get `grace_period` seconds to finish (None: no limit), then the
        rest is hard-stopped (each gets a FAILED final result). `block=False` returns at once: the
        thread finishes the queue gracefully and releases the cache when it ends."""
        with self._lock:
            if self._destroyed:
                return
        self.stop(block=False)
        thread = self._thread
        if self.is_running() and thread is not threading.current_thread():
            if not block:
                with self._lock:
                    self._release_on_exit = True
                if self.is_running():
                    return
            else:
                thread.join(grace_period)
                if thread.is_alive():
                    logger.warning("destroy(): requests still running after %ss; hard-stopping", grace_period)
                    self.stop(block=True, timeout=HARD_STOP_JOIN_S, hard_stop=True)
                if thread.is_alive():
                    logger.error(
                        "destroy(): the manager thread did not end; the cache is released when it does"
                    )
                    with self._lock:
                        self._release_on_exit = True
                    return
        self._release_engine()

    @contextmanager
    def pause(self) -> Iterator[None]:
        """Hold the loop between two steps (pages and in-flight requests kept), e.g. to update weights."""
        with self._lock:
            self._pause_requests += 1
            self._lock.notify_all()
            while self.is_running() and not self._paused and threading.current_thread() is not self._thread:
                self._lock.wait(timeout=0.1)
        self._pause_holders.count = getattr(self._pause_holders, "count", 0) + 1
        try:
            yield
        finally:
            self._pause_holders.count -= 1
            with self._lock:
                self._pause_requests -= 1
                self._lock.notify_all()

    # -- results -----------------------------------------------------------------------
    def get_result(
        self, request_id: str | None = None, timeout: float | None = None
    ) -> GenerationOutput | None:
        """The next output in the shared queue: final results of unclaimed requests, and the partial
        outputs of unclaimed streaming requests before their final one, in order. With `request_id`,
        the next one of that request (the others stay queued).

        Returns None on timeout, or at once when no such output can arrive any more. Raises
        `ManagerDeadError` if the thread died and nothing is left, and `RuntimeError` when, without a
        timeout, outputs are outstanding but the manager is not running (it would wait forever)."""
        return self._router.get(request_id, timeout)

    def __iter__(self) -> Iterator[GenerationOutput]:
        """Yield what `get_result()` returns, as it arrives, until nothing unclaimed is outstanding.

        Raises `ManagerDeadError` if the thread died, `RuntimeError` if requests are outstanding
        but the manager is not running.
        """
        while True:
            result = self._router.get(timeout=0.1)
            if result is not None:
                yield result
                continue
            if not self._router.has_unclaimed_work():
                return
            if not self.is_running():
                self._router.check_alive()
                if self._router.has_unclaimed_work():
                    raise RuntimeError(
                        "requests are outstanding but the manager is not running: call start()"
                    )

    def request_id_iter(self, request_id: str) -> Iterator[GenerationOutput]:
        """Yield the outputs of `request_id` not yet delivered to anyone (growing partials if streaming),
        ending with its final one.

        The request is claimed at the call: later outputs no longer reach `get_result()`. A new iterator
        resumes where the previous one stopped, so `next(manager.request_id_iter(rid))` per chunk loses
        and repeats nothing. Raises `KeyError` (`UnknownRequestError`) at the call for an unknown id or
        one whose final output was already delivered, and `RuntimeError` while waiting if the manager is
        not running."""
        return blocking_channel(self._router, request_id)

    def stream(self, request_id: str) -> AsyncIterator[GenerationOutput]:
        """`async for output in manager.stream(request_id)`: the asyncio counterpart of `request_id_iter`.

        Call it inside a running event loop; the loop is never blocked by the manager."""
        return async_channel(self._router, request_id)

    def register_result_handler(self, request_id: str, callback: Deliver) -> None:
        """Call `callback(output)` for each output of `request_id` (partials if streaming, then the
        final one), in order and one at a time. Exceptions in the callback are logged.

        Registered inside a running event loop, the callback runs on that loop (as in transformers);
        otherwise on the manager thread. An id not submitted yet is remembered and attached when a
        request with that id is submitted."""
        self._router.register_handler(request_id, callback)
        with self._lock:
            self._lock.notify_all()  # a backlog handed to the loop thread: wake it

    def stats(self) -> ManagerStats:
        with self._lock:
            engine = self.engine
            running = len(engine.scheduler.running) if engine else 0
            waiting = len(engine.scheduler.waiting) if engine else 0
            offload = engine.offload if engine else None
            prefix = engine.scheduler.allocator.prefix if engine else None
            return ManagerStats(
                queued=len(self._incoming) + waiting,
                running=running,
                finished=self._counts[RequestStatus.FINISHED],
                failed=self._counts[RequestStatus.FAILED],
                cancelled=self._counts[RequestStatus.CANCELLED],
                preemptions=engine.scheduler.num_preemptions if engine else 0,
                pages_in_use=engine.cache.num_used_pages if engine else 0,
                pages_total=engine.cache.num_total_pages if engine else 0,
                pages_in_use_by_group=engine.scheduler.allocator.pages_in_use() if engine else {},
                prefill_tokens=engine.counters.prefill_tokens if engine else 0,
                decode_tokens=engine.counters.decode_tokens if engine else 0,
                prefix_cache_hit_rate=prefix.stats.hit_rate if prefix else 0.0,
                prefix_cache_hit_tokens=prefix.stats.hit_tokens if prefix else 0,
                prefix_cache_pages=engine.scheduler.allocator.num_cached_pages if engine else 0,
                prefix_cache_evictions=engine.scheduler.allocator.num_evictions if engine else 0,
                tokens_per_second=self._throughput.rate(),
                delivered_tokens=self._throughput.total,
                recomputed_tokens=engine.scheduler.recomputed.total if engine else 0,
                swapped_out=offload.num_swapped_out if offload else 0,
                swap_out_pages=offload.swap_out_pages if offload else 0,
                swap_in_pages=offload.swap_in_pages if offload else 0,
            )
