"""`Lifecycle`: how the manager's thread starts, stops and ends for good (`ContinuousBatchingManager.start`,
`stop`, `join`, `destroy`), and the session's step driver the built-in's `batch_processor` names (compat.py).

A stop refuses new submissions and ends the thread after the queue (or at once, every unfinished request
failed: a hard stop); on a manager that is not running the queued requests end at once, unless kept for
the next session. `destroy` gives the queue a grace period, then hard-stops, and drops the engine (the cache
with it) when the thread has ended: at once, or on the loop thread as it exits.
"""

from __future__ import annotations

import logging
import threading
import time

from transformers import PreTrainedModel

from ..invariants import present
from .compat import BatchProcessorView
from .delivery.results import ResultRouter
from .loop import HARD_STOP_ERROR, NOT_RUN_ERROR, ManagerLoop
from .state import ManagerState

logger = logging.getLogger(__name__)

# Where `stop(keep_for_next_session=True)` keeps the manager; `init_continuous_batching` reuses it.
CACHED_MANAGER_ATTR = "_transformers_cb_manager"
# After a hard stop, the thread ends at the next step boundary; a step that takes longer is stuck.
HARD_STOP_JOIN_S = 60.0


class Lifecycle:
    """Args: the manager (`owner`: what the model caches for the next session), its `model`, shared `state`,
    `loop` and `router`."""

    def __init__(
        self,
        owner: object,
        model: PreTrainedModel,
        state: ManagerState,
        loop: ManagerLoop,
        router: ResultRouter,
    ) -> None:
        self._owner = owner
        self._model = model
        self._state = state
        self._loop = loop
        self._router = router
        self.batch_processor: BatchProcessorView | None = None  # compat: the started session's

    def start(self) -> None:
        state, thread = self._state, self._loop.thread
        if (
            thread is not None
            and thread.is_alive()
            and state.stop_requested
            and not self._loop.is_loop_thread()
        ):
            thread.join()  # a `stop(block=False)` is under way: let it end, then start a new session
        with state.lock:
            if state.destroyed or state.release_on_exit:
                raise RuntimeError("this ContinuousBatchingManager was destroyed and cannot be restarted")
            if self._loop.is_running():
                logger.warning("ContinuousBatchingManager.start(): already running")
                return
            self._router.check_alive()  # a dead thread's manager cannot be restarted: ManagerDeadError
            state.accepting, state.stop_requested, state.hard_stop = True, False, False
            self._router.set_closed(False)
            self.batch_processor = BatchProcessorView(present(state.engine), self._num_incoming)
            self._loop.start()

    def _num_incoming(self) -> int:
        with self._state.lock:
            return len(self._state.incoming)

    def stop(self, block: bool, timeout: float | None, keep_for_next_session: bool, hard_stop: bool) -> None:
        if keep_for_next_session:
            setattr(self._model, CACHED_MANAGER_ATTR, self._owner)
        else:
            self.batch_processor = None
        state = self._state
        with state.lock:
            state.accepting = False
            state.stop_requested = True
            state.hard_stop = state.hard_stop or hard_stop
            state.lock.notify_all()
        if not self._loop.is_running():
            if hard_stop or not keep_for_next_session:
                self._loop.fail_everything(HARD_STOP_ERROR if hard_stop else NOT_RUN_ERROR)
            self._router.set_closed(True)
            return
        if block:
            self.join(time.perf_counter(), timeout)

    def join(self, stop_trigger_time: float, timeout: float | None) -> None:
        thread = self._loop.thread
        if thread is None or thread is threading.current_thread():
            return
        thread.join(timeout)
        if thread.is_alive():
            logger.warning("the continuous batching thread did not end within the timeout (%s s)", timeout)
        else:
            logger.info(
                "continuous batching thread ended %.2f s after stop", time.perf_counter() - stop_trigger_time
            )

    def destroy(self, block: bool, grace_period: float | None) -> None:
        state = self._state
        with state.lock:
            if state.destroyed:
                return
        self.stop(block=False, timeout=None, keep_for_next_session=False, hard_stop=False)
        thread = self._loop.thread
        if self._loop.is_running() and not self._loop.is_loop_thread():
            if not block:
                with state.lock:
                    state.release_on_exit = True
                if self._loop.is_running():
                    return
            elif thread is not None:
                thread.join(grace_period)
                if thread.is_alive():
                    logger.warning("destroy(): requests still running after %ss; hard-stopping", grace_period)
                    self.stop(
                        block=True, timeout=HARD_STOP_JOIN_S, keep_for_next_session=False, hard_stop=True
                    )
                if thread.is_alive():
                    logger.error(
                        "destroy(): the manager thread did not end; the cache is released when it does"
                    )
                    with state.lock:
                        state.release_on_exit = True
                    return
        self.release_engine()

    def release_engine(self) -> None:
        """The end of `destroy()` (on the loop thread after a non-blocking one): drop the engine, and the
        cache with it, and the model's reference to the manager."""
        with self._state.lock:
            self._state.destroyed = True
            self._state.engine = None
        self.batch_processor = None
        if getattr(self._model, CACHED_MANAGER_ATTR, None) is self._owner:
            delattr(self._model, CACHED_MANAGER_ATTR)
