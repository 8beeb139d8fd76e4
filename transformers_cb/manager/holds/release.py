"""`release_cache()` / `resume_cache()`: the cache's memory given back while a trainer trains (docs/manager.md).

Both sides of it: the callers' (`release`, `resume`: they record the wish under the state's lock and wait
for the loop) and the loop thread's (`hold`: between two sessions, outside the engine's run session, so the
model is the user's again; engine/cache_release.py frees and rebuilds the tensors). On a manager that is not
running the caller applies it at once (the engine is idle). While released, submissions and cancellations
are accepted and a pause's weight check is applied (there is no KV to keep); requests wait, and run after
the resume, which first checks the weights (a change while released is a new weight version).
"""

from __future__ import annotations

from collections.abc import Callable

from ...engine.cache_release import ReleasedCache, release_cache, release_problem, restore_cache
from ...engine.engine import Engine
from ..state import ManagerState

# How long a caller waits for the loop before it looks again (it is woken on changes).
WAIT_S = 0.1


class CacheRelease:
    """Args: state: the manager's shared state; is_running: whether its loop thread runs; is_loop_thread:
    whether the caller is that thread (a result handler: the wish is recorded and applied at the next step
    boundary, never in the middle of a step); idle_work: what the loop applies while it holds (submissions,
    cancellations, weight checks)."""

    def __init__(
        self,
        state: ManagerState,
        is_running: Callable[[], bool],
        is_loop_thread: Callable[[], bool],
        idle_work: Callable[[], None],
    ) -> None:
        self._state = state
        self._is_running = is_running
        self._is_loop_thread = is_loop_thread
        self._idle_work = idle_work

    # -- the callers ---------------------------------------------------------------------------
    def release(self) -> None:
        state = self._state
        with state.lock:
            engine = state.engine
            if engine is None:
                raise RuntimeError("the manager was destroyed: there is no cache to release")
            problem = release_problem(engine)
            if problem is not None:
                raise ValueError(f"release_cache() does not support {problem} yet")
            state.release_requested = True
            state.lock.notify_all()
            if self._is_loop_thread():
                return
            if not self._is_running():
                if state.released_cache is None:
                    state.released_cache = release_cache(engine)
                return
            while state.released_cache is None and self._is_running() and not self._stopping():
                state.lock.wait(timeout=WAIT_S)

    def resume(self) -> None:
        state = self._state
        with state.lock:
            state.release_requested = False
            state.lock.notify_all()
            engine = state.engine
            if self._is_loop_thread():
                return
            if not self._is_running():
                if engine is not None and state.released_cache is not None:
                    self._rebuild(engine, state.released_cache)
                return
            while state.released_cache is not None and self._is_running():
                state.lock.wait(timeout=WAIT_S)

    def released(self) -> bool:
        with self._state.lock:
            return self._state.released_cache is not None

    # -- the loop thread -----------------------------------------------------------------------
    def wanted(self) -> bool:
        """Whether the loop should leave its session and release (lock held by the caller)."""
        return self._state.release_requested and not self._stopping()

    def hold(self, engine: Engine) -> None:
        """Release (unless a caller already did), hold until `resume_cache()` or a stop, rebuild."""
        state = self._state
        with state.lock:
            released = state.released_cache
            if released is None and not self.wanted():
                return
        if released is None:
            released = release_cache(engine)
            with state.lock:
                state.released_cache = released
                state.lock.notify_all()
        try:
            while True:
                self._idle_work()
                with state.lock:
                    state.paused = state.pause_requests > 0  # a pause() while released holds at once
                    if not self.wanted():
                        break
                    state.lock.wait(timeout=WAIT_S)
        finally:
            with state.lock:
                self._rebuild(engine, released)
                state.lock.notify_all()

    def _rebuild(self, engine: Engine, released: ReleasedCache) -> None:
        """The tensors back, then the weight check (lock held by the caller)."""
        restore_cache(engine, released)
        self._state.released_cache = None
        engine.check_weights("recompute")  # trained while released: a new version (no KV was kept anyway)

    def _stopping(self) -> bool:
        return self._state.stop_requested or self._state.hard_stop
