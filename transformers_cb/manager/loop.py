"""What runs on the manager's background thread: the loop around `Engine.step()`.

`ManagerLoop` owns the thread. Callers record submissions, cancellations and stop / pause requests in
the shared `ManagerState` under its lock; the loop applies them at step boundaries, so only this thread
touches the engine while it runs. Every request leaves through `_publish_final`, which counts its final
status and hands its one final output to the router; `fail_everything` is the exit of whatever is left.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from transformers import PreTrainedModel

from ..distributed import TensorParallelError
from ..engine.engine import Engine
from ..engine.follower import FollowerEngine
from ..invariants import present
from ..requests import Request, RequestStatus
from .delivery.results import ResultRouter
from .holds.release import CacheRelease
from .state import ManagerState
from .stats import ThroughputWindow
from .torch_threads.adaptive_threads import AdaptiveThreads
from .torch_threads.threads import ThreadSettings

logger = logging.getLogger(__name__)

HARD_STOP_ERROR = "RuntimeError: the manager was hard-stopped before this request finished"
NOT_RUN_ERROR = "RuntimeError: the manager was stopped before it ran this request (it was not running)"
THREAD_NAME = "transformers-cb"
# How long an idle or paused loop sleeps before it looks at the state again (it is woken on changes).
IDLE_WAIT_S = 0.1


class ManagerLoop:
    """The background thread of one manager.

    Args:
        state: the state shared with the callers (its lock guards it).
        router: where outputs go.
        throughput: counts the tokens delivered to users.
        model: switched to its paged attention backend while the thread runs.
        release: called by the thread as it ends after a non-blocking `destroy()` (`state.release_on_exit`).
        adaptive_threads: sets the thread's torch threads between steps to the cores other processes leave
            idle (adaptive_threads.py); None: the count it starts with (the starting thread's) is kept.
    """

    def __init__(
        self,
        state: ManagerState,
        router: ResultRouter,
        throughput: ThroughputWindow,
        model: PreTrainedModel,
        release: Callable[[], None],
        adaptive_threads: AdaptiveThreads | None = None,
    ) -> None:
        self._state = state
        self._threads = adaptive_threads
        self._router = router
        self._throughput = throughput
        self._model = model
        self._release = release
        self.thread: threading.Thread | None = None
        self.steps_this_session = 0  # `Engine.step()` calls since the last `start()`
        # `release_cache()` / `resume_cache()`: the loop leaves its run session and holds (release.py).
        self.cache_release = CacheRelease(state, self.is_running, self.is_loop_thread, self._idle_work)

    # -- the caller side -------------------------------------------------------------------
    def start(self) -> None:
        """Start a new thread, at the speed of the calling one (`ThreadSettings`)."""
        settings = ThreadSettings.capture()
        self.steps_this_session = 0
        self.thread = threading.Thread(target=self._run, args=(settings,), name=THREAD_NAME, daemon=True)
        self.thread.start()

    def is_running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def is_loop_thread(self) -> bool:
        return self.thread is threading.current_thread()

    def apply_weight_check(self) -> None:
        """Apply the weight check owed by the end of a pause (or `weights_updated()`) once no pause holds
        the loop (loop thread between two steps, or a manager not running): a change is a new weight
        version (`Engine.check_weights`); the requests it aborts get their final results here."""
        state = self._state
        with state.lock:
            owed = state.weight_check
            if owed is None or state.pause_requests:
                return
            state.weight_check = None
            engine = state.engine
        try:
            ended = engine.check_weights(owed.mode, owed.changed) if engine is not None else None
            for request in ended or ():
                self._publish_final(request)
        except Exception as error:  # noqa: BLE001 - the thread lives on; no request may run on unknown KV
            logger.exception("continuous batching weight check failed; failing the running requests")
            if engine is not None:
                self._fail_running(engine, f"weight check failed: {type(error).__name__}: {error}")
                engine.forget_prefix_pages()
        finally:
            with state.lock:
                state.weight_checked = max(state.weight_checked, owed.ticket)
                state.lock.notify_all()

    def apply_submissions(self) -> None:
        """Move new requests into the engine and apply cancellations (loop thread, or idle engine)."""
        state = self._state
        with state.lock:
            incoming, cancels = state.take_submissions()
            engine = state.engine
        if engine is None:
            return
        if incoming and not engine.is_follower and not engine.has_work():
            engine.check_weights()  # the weights may have changed while it idled (a weight sync)
        for request in incoming:
            engine.add(request)
            refusal = engine.adapter_refusal(
                request
            )  # a weight change since its submission (docs/adapters.md)
            for member in request.family if refusal is not None else ():
                engine.finish(member, RequestStatus.FAILED, refusal)
                self._publish_final(member)
        for request_id in cancels:
            cancelled = state.live.get(request_id)
            if cancelled is not None and not cancelled.is_finished:
                engine.finish(cancelled, RequestStatus.CANCELLED, "cancelled by cancel_request()")
                self._publish_final(cancelled)

    def fail_everything(self, message: str) -> None:
        """Give every unfinished request its one final result: FAILED with `message`."""
        state = self._state
        with state.lock:
            live = list(state.live.values())
            state.incoming.clear()
            engine = state.engine
        for request in live:
            if not request.is_finished:
                if engine is not None:
                    engine.finish(request, RequestStatus.FAILED, message)
                else:
                    request.set_status(RequestStatus.FAILED)
                    request.error = message
            self._publish_final(request)

    # -- the thread ------------------------------------------------------------------------
    def _run(self, settings: ThreadSettings) -> None:
        state = self._state
        engine = state.engine
        try:
            settings.apply()
            if self._threads is not None:
                self._threads.start()
            if isinstance(engine, FollowerEngine):
                with engine.session():
                    engine.replay_session()  # a tensor-parallel follower replays rank 0's session
            else:
                # `start()` refuses a destroyed manager, whose engine is None.
                self._serve(present(engine, "the thread starts with an engine"))
        except BaseException as error:  # noqa: BLE001 - the thread must not die silently
            logger.exception("continuous batching manager thread died")
            with state.lock:
                state.accepting = False  # later submissions are refused, not queued for no one
                state.thread_status.fatal_error = error
            try:
                self.fail_everything(f"the manager thread died: {type(error).__name__}: {error}")
            finally:
                self._router.mark_dead(error)  # even if failing the requests raised: waiters must wake
        finally:
            if engine is not None:
                engine.end_session()  # tensor parallelism: the followers' sessions end with this one
            self._router.set_closed(True)
            if state.release_on_exit:
                self._release()

    def _serve(self, engine: Engine) -> None:
        """Run sessions until the loop ends: between two, the cache is released and held (`release_cache()`),
        outside the engine's run session, so that the model is the user's while it is."""
        while True:
            self.cache_release.hold(engine)
            with engine.session():
                if not self._loop(engine):
                    return

    def _idle_work(self) -> None:
        """What a held loop still applies: weight checks owed by pauses, submissions, cancellations."""
        self.apply_weight_check()
        self.apply_submissions()
        self._router.drain_handed_over()

    def _loop(self, engine: Engine) -> bool:
        """Step until the loop ends (False) or a `release_cache()` asks it to leave the session (True)."""
        state = self._state
        while True:
            self.apply_weight_check()  # before any step after a pause that changed the weights
            self.apply_submissions()
            if state.pause_requests or not engine.has_work():
                engine.heartbeat()  # tensor-parallel followers wait in a collective bounded by a timeout
            self._router.drain_handed_over()
            with state.lock:
                if state.hard_stop:
                    break
                if self.cache_release.wanted():
                    return True
                if state.pause_requests:
                    state.paused = True
                    state.lock.notify_all()
                    state.lock.wait(timeout=IDLE_WAIT_S)
                    continue
                state.paused = False
                if state.weight_check is not None:
                    continue  # a pause ended since the top of the loop: its check comes before any step
                if not engine.has_work():
                    if state.stop_requested and not state.incoming:
                        return False
                    if not state.incoming:
                        state.lock.wait(timeout=IDLE_WAIT_S)
                    continue
            if self._threads is not None:
                self._threads.tick()
            self._step(engine)
        self.fail_everything(HARD_STOP_ERROR)
        return False

    def _step(self, engine: Engine) -> None:
        self.steps_this_session += 1
        try:
            result = engine.step()
        except TensorParallelError:
            raise  # the group is broken: the thread ends and every request gets its failure
        except Exception as error:  # noqa: BLE001 - a scheduler bug fails the involved requests only
            logger.exception("continuous batching step raised outside the model forward")
            self._fail_running(engine, f"step failed: {type(error).__name__}: {error}")
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

    def _fail_running(self, engine: Engine, message: str) -> None:
        """Fail every running request with `message` (an error outside the model forward)."""
        for request in engine.running_requests():
            engine.finish(request, RequestStatus.FAILED, message)
            self._publish_final(request)

    def _publish_final(self, request: Request) -> None:
        """The one exit of every request: count its final status, then route its final output."""
        state = self._state
        with state.lock:
            if state.live.pop(request.request_id, None) is None:
                return
            state.counts[request.status] = state.counts.get(request.status, 0) + 1
        self._router.publish(request.to_output())
