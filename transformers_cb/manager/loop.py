"""What runs on the manager's background thread: the loop around `Engine.step()`.

`ManagerLoop` is the thread-side half of `ContinuousBatchingManager` (manager.py holds the public,
caller-side half). Submissions, cancellations and stop / pause requests are recorded by callers under
`_lock`; the loop applies them at step boundaries, so only this thread touches the engine while it runs.
Every request leaves through `_publish_final`, which hands its one final output to the router.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass

import torch

from ..attention.selection import paged_attention
from ..distributed import TensorParallelError
from ..engine.engine import Engine
from ..requests import Request, RequestStatus
from .results import ResultRouter
from .stats import ThroughputWindow
from .threads import ThreadSettings

logger = logging.getLogger(__name__)

# Where `stop(keep_for_next_session=True)` keeps the manager; `init_continuous_batching` reuses it.
CACHED_MANAGER_ATTR = "_transformers_cb_manager"
HARD_STOP_ERROR = "RuntimeError: the manager was hard-stopped before this request finished"
NOT_RUN_ERROR = "RuntimeError: the manager was stopped before it ran this request (it was not running)"


@dataclass
class BackgroundThreadStatus:
    """What transformers' serving code reads before each request and in `/health`.

    `fatal_error` is None while the loop lives (or has not started), and the exception that killed the
    thread once it died; a dead manager cannot be restarted."""

    fatal_error: BaseException | None = None


class ManagerLoop:
    """State shared by callers and the loop thread, and the loop itself (see the module docstring)."""

    engine: Engine | None
    model: torch.nn.Module

    def _init_loop_state(self) -> None:
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
        self._release_on_exit = False  # a non-blocking destroy(): the thread releases the engine
        self._thread: threading.Thread | None = None
        self._thread_status = BackgroundThreadStatus()
        self._throughput = ThroughputWindow()
        self._counts = {RequestStatus.FINISHED: 0, RequestStatus.FAILED: 0, RequestStatus.CANCELLED: 0}

    # -- the thread ------------------------------------------------------------------------
    def _run(self, settings: ThreadSettings) -> None:
        tp = self.engine.tp if self.engine is not None else None
        try:
            settings.apply()
            target = self.engine.step_options.attn_implementation if self.engine is not None else None
            with paged_attention(self.model, target), torch.inference_mode():
                if tp is not None and not tp.is_driver:
                    self._follow(self.engine)
                else:
                    self._loop()
        except BaseException as error:  # noqa: BLE001 - the thread must not die silently
            logger.exception("continuous batching manager thread died")
            with self._lock:
                self._accepting = False  # later submissions are refused, not queued for no one
                self._thread_status.fatal_error = error
            try:
                self._fail_everything(f"the manager thread died: {type(error).__name__}: {error}")
            finally:
                self._router.mark_dead(error)  # even if failing the requests raised: waiters must wake
        finally:
            if tp is not None and tp.is_driver:
                tp.try_stop()  # the followers' sessions end with this one (skipped if the group broke)
            self._router.set_closed(True)
            if self._release_on_exit:
                self._release_engine()

    def _release_engine(self) -> None:
        """The end of `destroy()`: drop the engine (and the cache with it) and the model's reference."""
        with self._lock:
            self._destroyed = True
            self.engine = None
        if getattr(self.model, CACHED_MANAGER_ATTR, None) is self:
            delattr(self.model, CACHED_MANAGER_ATTR)

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
            self._router.drain_handed_over()
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
        delivered = 0
        for request in result.progressed:
            if request.streaming:
                self._router.publish(request.to_output())
                delivered += 1
        for request in result.finished:  # ManagerStats.tokens_per_second counts delivered tokens only
            if request.status == RequestStatus.FINISHED:
                # A streamed request's earlier tokens were counted with its partial outputs.
                delivered += 1 if request.streaming else len(request.generated_ids)
            self._publish_final(request)
        self._throughput.add(delivered)

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
