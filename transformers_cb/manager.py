"""`ContinuousBatchingManager`: a background thread that runs the engine while requests arrive.

Submissions, cancellations and pauses are recorded under one lock and applied
by the loop thread at step boundaries, so the engine itself is only ever
touched by one thread. Results flow out through `ResultRouter`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel

from .attention.selection import paged_attention
from .config import ContinuousBatchingConfig
from .distributed import TensorParallelError
from .engine import Engine
from .interop import as_cb_config, as_workload_hints
from .requests import GenerationOutput, Request, RequestStatus
from .results import Deliver, ResultRouter, async_channel, blocking_channel
from .sampling import check_processor_kwargs
from .stats import ManagerStats, ThroughputWindow
from .threads import ThreadSettings

logger = logging.getLogger(__name__)

# Where `stop(keep_for_next_session=True)` keeps the manager; `init_continuous_batching` reuses it.
CACHED_MANAGER_ATTR = "_transformers_cb_manager"
HARD_STOP_ERROR = "RuntimeError: the manager was hard-stopped before this request finished"


class ContinuousBatchingManager:
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
    ) -> None:
        self.model = model
        hints = as_workload_hints(workload_hints)
        self.engine: Engine | None = Engine(
            model,
            generation_config,
            as_cb_config(continuous_batching_config),
            workload=hints.workload() if hints is not None else None,
        )
        self.max_queue_size = self.engine.cb_config.max_queue_size
        self._router = ResultRouter()
        self._lock = threading.Condition()
        self._incoming: deque[Request] = deque()
        self._cancels: set[str] = set()
        self._live: dict[str, Request] = {}  # submitted and not final yet
        self._accepting = True
        self._stop_requested = False
        self._hard_stop = False
        self._pause_requests = 0
        self._paused = False
        self._destroyed = False
        self._thread: threading.Thread | None = None
        self._throughput = ThroughputWindow()
        self._counts = {RequestStatus.FINISHED: 0, RequestStatus.FAILED: 0, RequestStatus.CANCELLED: 0}

    # -- lifecycle ---------------------------------------------------------------------
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
            if self._destroyed:
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
        with paged_attention(self.model), torch.inference_mode():
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
        """
        if keep_for_next_session:
            setattr(self.model, CACHED_MANAGER_ATTR, self)
        with self._lock:
            self._accepting = False
            self._stop_requested = True
            self._hard_stop = self._hard_stop or hard_stop
            self._lock.notify_all()
        if not self.is_running():
            if hard_stop:
                self._fail_everything(HARD_STOP_ERROR)
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

    def destroy(self) -> None:
        """Stop (gracefully) if needed and release the cache; the manager cannot restart afterwards."""
        self.stop(block=True)
        if self.is_running():
            self.stop(block=True, hard_stop=True)
        with self._lock:
            self._destroyed = True
            self.engine = None
        if getattr(self.model, CACHED_MANAGER_ATTR, None) is self:
            delattr(self.model, CACHED_MANAGER_ATTR)

    @contextmanager
    def pause(self) -> Iterator[None]:
        """Hold the loop between two steps (pages and in-flight requests kept), e.g. to update weights."""
        with self._lock:
            self._pause_requests += 1
            self._lock.notify_all()
            while self.is_running() and not self._paused and threading.current_thread() is not self._thread:
                self._lock.wait(timeout=0.1)
        try:
            yield
        finally:
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
        record_timestamps: bool = False,
        eos_token_id: int | list[int] | None = None,
        **logit_processor_kwargs: Any,
    ) -> str | None:
        """Submit one request and return its id, or None (with a warning) after `stop()`.

        `record_timestamps` gives the outputs `timestamps` (one `time.perf_counter()` per token);
        `logit_processor_kwargs` are per-request sampling parameters (`temperature`, `top_k`, `top_p`).

        Raises:
            ValueError: bad input (empty prompt, token outside the vocabulary, `max_new_tokens <= 0`,
                too long for the model or the whole cache) or a duplicate live `request_id`.
            queue.Full: `max_queue_size` requests are already waiting to be scheduled.
            RuntimeError: the manager was destroyed.
        """
        check_processor_kwargs(logit_processor_kwargs)
        ids = self._submit(
            [(input_ids, request_id)],
            max_new_tokens,
            streaming,
            eos_token_id,
            record_timestamps,
            indexed=False,
        )
        return None if ids is None else ids[0]

    def add_requests(
        self,
        inputs: Sequence[Sequence[int]],
        max_new_tokens: int | None = None,
        streaming: bool = False,
        record_timestamps: bool = False,
        eos_token_id: int | list[int] | None = None,
        **logit_processor_kwargs: Any,
    ) -> list[str] | None:
        """Submit many requests at once and return their ids in input order, or None (with a
        warning) after `stop()`. All or nothing: if any input is invalid (`ValueError` naming
        `inputs[i]`), none is submitted. Other arguments as in `add_request`."""
        check_processor_kwargs(logit_processor_kwargs)
        items = [(input_ids, None) for input_ids in inputs]
        return self._submit(items, max_new_tokens, streaming, eos_token_id, record_timestamps, indexed=True)

    def _submit(
        self,
        items: list[tuple[Any, str | None]],
        max_new_tokens: int | None,
        streaming: bool,
        eos_token_id: int | list[int] | None,
        record_timestamps: bool,
        indexed: bool,
    ) -> list[str] | None:
        with self._lock:
            if self.engine is None:
                raise RuntimeError("this ContinuousBatchingManager was destroyed")
            if self.engine.is_follower:
                raise RuntimeError(
                    f"tensor parallelism: submit requests on rank 0; this is rank {self.engine.tp.rank}, "
                    "which only replays rank 0's steps (start() and stop() it like rank 0's manager)"
                )
            if not self._accepting:
                logger.warning("ContinuousBatchingManager is stopped: %d request(s) refused", len(items))
                return None
            waiting = len(self._incoming) + self._num_engine_waiting()
            if self.max_queue_size and waiting + len(items) > self.max_queue_size:
                raise queue.Full(
                    f"max_queue_size={self.max_queue_size}: {waiting} requests are already waiting, "
                    f"{len(items)} more do not fit"
                )
            requests: list[Request] = []
            taken = set(self._live)
            for index, (input_ids, request_id) in enumerate(items):
                label = f"inputs[{index}]" if indexed else None
                if request_id is None:
                    request_id = self.engine.new_request_id(taken)
                elif not isinstance(request_id, str):
                    raise ValueError(f"request_id must be a str, got {type(request_id).__name__}")
                elif request_id in taken:
                    raise ValueError(f"request_id {request_id!r} is already in use by a live request")
                requests.append(
                    self.engine.build_request(
                        input_ids,
                        request_id,
                        max_new_tokens,
                        eos_token_id,
                        streaming,
                        label=label,
                        record_timestamps=record_timestamps,
                    )
                )
                taken.add(request_id)
            for request in requests:
                self._live[request.request_id] = request
                self._router.expect(request.request_id, streaming)
                self._incoming.append(request)
            self._lock.notify_all()
        return [request.request_id for request in requests]

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
        """Next finished result (or None on timeout). With `request_id`, a non-matching result is put
        back and None returned. Raises `ManagerDeadError` if the thread died and nothing is left."""
        return self._router.get(request_id, timeout)

    def __iter__(self) -> Iterator[GenerationOutput]:
        """Yield final results of unclaimed requests as they finish, until none is outstanding.

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
        """Yield growing partial outputs of a streaming request, ending with its final output.

        The request is claimed at the call (`ValueError` at once for an unknown id)."""
        return blocking_channel(self._router, request_id)

    def stream(self, request_id: str) -> AsyncIterator[GenerationOutput]:
        """`async for output in manager.stream(request_id)`: the asyncio counterpart of `request_id_iter`.

        Call it inside a running event loop; the loop is never blocked by the manager."""
        return async_channel(self._router, request_id)

    def register_result_handler(self, request_id: str, callback: Deliver) -> None:
        """Call `callback(output)` from the manager thread for each output of `request_id`
        (partials if streaming, then the final one). Exceptions in the callback are logged."""
        if not self._router.claim(request_id, callback):
            raise ValueError(
                f"unknown request id {request_id!r} (never submitted, or its result was already taken)"
            )

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
            )

    # -- the loop thread ----------------------------------------------------------------
    def _num_engine_waiting(self) -> int:
        return len(self.engine.scheduler.waiting) if self.engine else 0

    def _has_queued_work(self) -> bool:
        with self._lock:
            return bool(self._incoming) or (self.engine is not None and self.engine.has_work())

    def _run(self, settings: ThreadSettings) -> None:
        tp = self.engine.tp if self.engine is not None else None
        try:
            settings.apply()
            with paged_attention(self.model), torch.inference_mode():
                if tp is not None and not tp.is_driver:
                    self._follow(self.engine)
                else:
                    self._loop()
        except BaseException as error:  # noqa: BLE001 - the thread must not die silently
            logger.exception("continuous batching manager thread died")
            with self._lock:
                self._accepting = False  # later submissions are refused, not queued for no one
            try:
                self._fail_everything(f"the manager thread died: {type(error).__name__}: {error}")
            finally:
                self._router.mark_dead(error)  # even if failing the requests raised: waiters must wake
        finally:
            if tp is not None and tp.is_driver:
                tp.try_stop()  # the followers' sessions end with this one (skipped if the group broke)
            self._router.set_closed(True)

    def _follow(self, engine: Engine) -> None:
        """A tensor-parallel follower's session: replay rank 0's steps until its manager stops."""
        engine.tp.stopped = False
        while not engine.tp.stopped:
            engine.step()

    def _loop(self) -> None:
        engine = self.engine
        while True:
            self._apply_submissions()
            if self._pause_requests or not engine.has_work():
                engine.heartbeat()  # tensor-parallel followers wait in a collective bounded by a timeout
            with self._lock:
                if self._hard_stop:
                    break
                if self._pause_requests:
                    self._paused = True
                    self._lock.notify_all()
                    self._lock.wait(timeout=0.1)
                    continue
                self._paused = False
                if not engine.has_work():
                    if self._stop_requested and not self._incoming:
                        return
                    if not self._incoming:
                        self._lock.wait(timeout=0.1)
                    continue
            self._step(engine)
        self._fail_everything(HARD_STOP_ERROR)

    def _step(self, engine: Engine) -> None:
        try:
            result = engine.step()
        except TensorParallelError:
            raise  # the group is broken: the thread ends and every request gets its failure
        except Exception as error:  # noqa: BLE001 - a scheduler bug fails the involved requests only
            logger.exception("continuous batching step raised outside the model forward")
            message = f"step failed: {type(error).__name__}: {error}"
            for request in list(engine.scheduler.running):
                engine.finish(request, RequestStatus.FAILED, message)
                self._publish_final(request)
            return
        self._throughput.add(len(result.progressed) + len(result.finished))
        for request in result.progressed:
            if request.streaming:
                self._router.publish(request.to_output())
        for request in result.finished:
            self._publish_final(request)

    def _apply_submissions(self) -> None:
        """Move new requests into the engine and apply cancellations (loop thread, or idle engine)."""
        with self._lock:
            incoming, self._incoming = list(self._incoming), deque()
            cancels, self._cancels = self._cancels, set()
            engine = self.engine
        if engine is None:
            return
        for request in incoming:
            engine.add(request)
        for request_id in cancels:
            request = self._live.get(request_id)
            if request is not None and not request.is_finished:
                engine.finish(request, RequestStatus.CANCELLED, "cancelled by cancel_request()")
                self._publish_final(request)

    def _publish_final(self, request: Request) -> None:
        with self._lock:
            if self._live.pop(request.request_id, None) is None:
                return
            self._counts[request.status] = self._counts.get(request.status, 0) + 1
        self._router.publish(request.to_output())

    def _fail_everything(self, message: str) -> None:
        """Give every unfinished request its one final result: FAILED with `message`."""
        with self._lock:
            live, self._incoming = list(self._live.values()), deque()
            engine = self.engine
        for request in live:
            if not request.is_finished:
                if engine is not None:
                    engine.finish(request, RequestStatus.FAILED, message)
                else:
                    request.set_status(RequestStatus.FAILED)
                    request.error = message
            self._publish_final(request)
