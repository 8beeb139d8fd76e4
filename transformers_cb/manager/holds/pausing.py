"""`Pauses` (the manager's `pause()` and `weights_updated()`): the loop held between two steps while a
caller changes the model, counted per thread (a nested or concurrent pause holds it until the last ends),
and the weight check the last pause owes: recorded in the shared state for the loop
(`ManagerLoop.apply_weight_check`), the exit waiting until it is applied. docs/manager.md, "Weight updates".
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from ...scheduler.weight_updates import UpdateMode
from ..loop import ManagerLoop
from ..state import ManagerState


class Pauses:
    """Args: the manager's shared `state` and its `loop` (whose thread the pause holds)."""

    def __init__(self, state: ManagerState, loop: ManagerLoop) -> None:
        self._state = state
        self._loop = loop
        self._holders = threading.local()  # per thread: how many `pause()` blocks it is inside

    def held_here(self) -> bool:
        """Whether the calling thread is inside a `pause()` block."""
        return getattr(self._holders, "count", 0) > 0

    @contextmanager
    def paused(self, update_mode: UpdateMode) -> Iterator[None]:
        """The loop held for the block; at the last block's end the weight check (by `update_mode`) is owed
        and waited for (`ContinuousBatchingManager.pause`)."""
        state = self._state
        with state.lock:
            state.pause_requests += 1
            state.lock.notify_all()
            while self._loop.is_running() and not state.paused and not self._loop.is_loop_thread():
                state.lock.wait(timeout=0.1)
        self._holders.count = getattr(self._holders, "count", 0) + 1
        try:
            yield
        finally:
            self._holders.count -= 1
            with state.lock:
                # A tensor-parallel follower decides nothing: rank 0's engine applies weight changes.
                checks = state.engine is not None and not state.engine.is_follower
                ticket = state.owe_weight_check(update_mode, False) if checks else 0
                state.pause_requests -= 1
                last = state.pause_requests == 0
                if last:
                    state.paused = False  # the next pause() waits until the loop holds again
                state.lock.notify_all()
            if last and checks:
                self._wait_for_weight_check(ticket)

    def weights_updated(self, update_mode: UpdateMode) -> None:
        """A change no version counter shows, applied as a pause's would be: when the last pause ends
        (inside one), else at once under a pause of its own (`ContinuousBatchingManager.weights_updated`)."""
        if self.held_here():
            with self._state.lock:  # applied when the last pause ends
                self._state.owe_weight_check(update_mode, True)
            return
        with self.paused(update_mode), self._state.lock:
            self._state.owe_weight_check(update_mode, True)

    def _wait_for_weight_check(self, ticket: int) -> None:
        """The end of the last pause: wait until the loop applied the weight check with `ticket` (at once
        on a manager whose thread does not run: nobody else touches the engine then)."""
        state = self._state
        if self._loop.is_loop_thread():
            return  # a result handler pausing: the loop applies it before its next step
        with state.lock:
            while state.weight_checked < ticket and self._loop.is_running():
                state.lock.wait(timeout=0.1)
            done = state.weight_checked >= ticket
        if not done:
            self._loop.apply_weight_check()
