"""`ContinuousBatchingManager`: a background thread that runs the engine while requests arrive.

This module is the caller-side half: lifecycle, submissions, results. The thread-side half (the loop
around `Engine.step()`) is `manager_loop.ManagerLoop`; results flow out through `results.ResultRouter`.
See docs/manager.md for the contract.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel

from .channels import async_channel, blocking_channel
from .config import ContinuousBatchingConfig
from .engine import Engine
from .manager_loop import HARD_STOP_ERROR, NOT_RUN_ERROR, BackgroundThreadStatus, ManagerLoop
from .requests import GenerationOutput, Request, RequestStatus
from .results import Deliver
from .stats import ManagerStats
from .threads import ThreadSettings

logger = logging.getLogger(__name__)

# destroy() lets queued and running requests finish for this long, then hard-stops them.
DESTROY_GRACE_S = 10.0
# After a hard stop, the thread ends at the next step boundary; a step that takes longer is stuck.
HARD_STOP_JOIN_S = 60.0


class ContinuousBatchingManager(ManagerLoop):
    """Serve requests with continuous batching from a background thread.

    Create it with `model.init_continuous_batching(...)` or
    `model.continuous_batching_context_manager(...)`. See docs/manager.md.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        generation_config: GenerationConfig | None = None,
        continuous_batching_config: ContinuousBatchingConfig | None = None,
    ) -> None:
        self.model = model
        self.engine: Engine | None = Engine(model, generation_config, continuous_batching_config)
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

    def stop(self, block: bool = True, timeout: float | None = None, hard_stop: bool = False) -> None:
        """Refuse new submissions and end the thread: after finishing queued and active requests
        (default), or at once with every unfinished request failed by a `RuntimeError` (`hard_stop`).

        On a manager that is not running, every request still queued ends at once (FAILED, with the
        reason): nothing would ever run it. Raises `RuntimeError` for a blocking graceful stop from
        inside `pause()` (the paused loop could never finish the queue)."""
        holds_pause = getattr(self._pause_holders, "count", 0) > 0
        if holds_pause and block and not hard_stop and self.is_running():
            raise RuntimeError(
                "stop() from inside pause() would wait forever: the loop is paused and cannot finish the "
                "queue; leave the pause first, or use hard_stop=True / block=False"
            )
        with self._lock:
            self._accepting = False
            self._stop_requested = True
            self._hard_stop = self._hard_stop or hard_stop
            self._lock.notify_all()
        if not self.is_running():
            self._fail_everything(HARD_STOP_ERROR if hard_stop else NOT_RUN_ERROR)
            self._router.set_closed(True)
            return
        if block and self._thread is not threading.current_thread():
            self._thread.join(timeout)

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
        with self._lock:
            self._destroyed = True
            self.engine = None

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

    # -- submissions -------------------------------------------------------------------
    def add_request(
        self,
        input_ids: Sequence[int] | torch.Tensor,
        request_id: str | None = None,
        max_new_tokens: int | None = None,
        streaming: bool = False,
        eos_token_id: int | list[int] | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
    ) -> str | None:
        """Submit one request and return its id, or None (with a warning) after `stop()`.

        Raises:
            ValueError: bad input (empty prompt, token outside the vocabulary, `max_new_tokens <= 0`,
                too long for the model or the whole cache) or a duplicate live `request_id`.
            queue.Full: `max_queue_size` requests are already waiting to be scheduled.
            RuntimeError: the manager was destroyed.
        """
        if any(v is not None for v in (temperature, top_k, top_p)):
            raise NotImplementedError(
                "per-request temperature/top_k/top_p need per_request_processors (not built yet)"
            )
        ids = self._submit([(input_ids, request_id)], max_new_tokens, streaming, eos_token_id, indexed=False)
        return None if ids is None else ids[0]

    def add_requests(
        self,
        inputs: Sequence[Sequence[int]],
        max_new_tokens: int | None = None,
        streaming: bool = False,
        eos_token_id: int | list[int] | None = None,
    ) -> list[str] | None:
        """Submit many requests at once and return their ids in input order, or None (with a
        warning) after `stop()`. All or nothing: if any input is invalid (`ValueError` naming
        `inputs[i]`), none is submitted."""
        items = [(input_ids, None) for input_ids in inputs]
        return self._submit(items, max_new_tokens, streaming, eos_token_id, indexed=True)

    def _submit(
        self,
        items: list[tuple[Any, str | None]],
        max_new_tokens: int | None,
        streaming: bool,
        eos_token_id: int | list[int] | None,
        indexed: bool,
    ) -> list[str] | None:
        with self._lock:
            if self.engine is None:
                raise RuntimeError("this ContinuousBatchingManager was destroyed")
            if not self._accepting:
                logger.warning("ContinuousBatchingManager is stopped: %d request(s) refused", len(items))
                self._drop_early_handlers(items)
                return None
            waiting = len(self._incoming) + self._num_engine_waiting()
            if self.max_queue_size and waiting + len(items) > self.max_queue_size:
                raise queue.Full(
                    f"max_queue_size={self.max_queue_size}: {waiting} requests are already waiting, "
                    f"{len(items)} more do not fit"
                )
            try:
                requests = self._build_requests(items, max_new_tokens, streaming, eos_token_id, indexed)
            except BaseException:
                self._drop_early_handlers(items)
                raise
            for request in requests:
                self._live[request.request_id] = request
                self._router.expect(request.request_id, streaming)
                self._incoming.append(request)
            self._lock.notify_all()
        return [request.request_id for request in requests]

    def _build_requests(
        self,
        items: list[tuple[Any, str | None]],
        max_new_tokens: int | None,
        streaming: bool,
        eos_token_id: int | list[int] | None,
        indexed: bool,
    ) -> list[Request]:
        """Validate every item (all or nothing); the lock is held."""
        requests: list[Request] = []
        taken = set(self._live) | self._router.ids_in_use()
        for index, (input_ids, request_id) in enumerate(items):
            label = f"inputs[{index}]" if indexed else None
            if request_id is None:
                request_id = self.engine.new_request_id(taken)
            elif not isinstance(request_id, str):
                raise ValueError(f"request_id must be a str, got {type(request_id).__name__}")
            elif request_id in taken:
                raise ValueError(
                    f"request_id {request_id!r} is already in use by a request whose outputs are not "
                    "all delivered yet"
                )
            requests.append(
                self.engine.build_request(
                    input_ids, request_id, max_new_tokens, eos_token_id, streaming, label=label
                )
            )
            taken.add(request_id)
        return requests

    def _drop_early_handlers(self, items: list[tuple[Any, str | None]]) -> None:
        for _, request_id in items:
            if isinstance(request_id, str):
                self._router.drop_early_handler(request_id)

    def cancel_request(self, request_id: str) -> None:
        """Cancel a pending or running request: its pages are freed at the next step boundary and
        it receives one final result with status CANCELLED. Unknown ids only log a warning."""
        with self._lock:
            if request_id not in self._live:
                logger.warning("cancel_request: unknown or already finished request %r", request_id)
                return
            self._cancels.add(request_id)
            self._lock.notify_all()
            if self.is_running():
                return
        # No loop to do it: apply now (the engine is idle, nobody else touches it).
        self._apply_submissions()

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
            return ManagerStats(
                queued=len(self._incoming) + waiting,
                running=running,
                finished=self._counts[RequestStatus.FINISHED],
                failed=self._counts[RequestStatus.FAILED],
                cancelled=self._counts[RequestStatus.CANCELLED],
                preemptions=engine.scheduler.num_preemptions if engine else 0,
                pages_in_use=engine.cache.pool.num_used_pages if engine else 0,
                pages_total=engine.cache.pool.num_pages if engine else 0,
                prefill_tokens=engine.counters.prefill_tokens if engine else 0,
                decode_tokens=engine.counters.decode_tokens if engine else 0,
                prefix_cache_hit_rate=0.0,
                tokens_per_second=self._throughput.rate(),
                delivered_tokens=self._throughput.total,
            )

    def _num_engine_waiting(self) -> int:
        return len(self.engine.scheduler.waiting) if self.engine else 0
