"""What the manager's callers and its loop thread share: one lock and the state it guards.

Callers (submissions, cancellations, stop / pause requests) write it under `lock`; the loop thread reads
it at step boundaries and applies it to the engine, so only that thread touches the engine while it runs.
`lock` is a condition: whoever changes something another side waits for calls `lock.notify_all()`.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

from ..engine.cache_release import ReleasedCache
from ..engine.engine import Engine
from ..requests import Request, RequestStatus
from ..scheduler.weight_updates import UpdateMode, stronger

# The final statuses `ManagerStats` counts.
COUNTED_STATUSES = (
    RequestStatus.FINISHED,
    RequestStatus.FAILED,
    RequestStatus.CANCELLED,
    RequestStatus.ABORTED,
)


@dataclass(frozen=True)
class WeightCheck:
    """A weight check the loop owes (`ManagerState.weight_check`): at the end of the last `pause()`, or of
    `weights_updated()`. `changed`: the weights changed for sure (else the fingerprint tells); `mode`: what
    becomes of the requests in flight (scheduler/weight_updates.py); `ticket`: the last request merged in."""

    mode: UpdateMode
    changed: bool
    ticket: int

    def merged(self, mode: UpdateMode, changed: bool, ticket: int) -> WeightCheck:
        return WeightCheck(stronger(self.mode, mode), self.changed or changed, ticket)


@dataclass
class BackgroundThreadStatus:
    """What transformers' serving code reads before each request and in `/health`.

    `fatal_error` is None while the loop lives (or has not started), and the exception that killed the
    thread once it died; a dead manager cannot be restarted."""

    fatal_error: BaseException | None = None


@dataclass(eq=False)
class ManagerState:
    """The manager's shared state; every field but `lock` is read and written with `lock` held."""

    engine: Engine | None  # None once destroyed
    lock: threading.Condition = field(default_factory=threading.Condition)
    incoming: deque[Request] = field(default_factory=deque)  # submitted, not handed to the engine yet
    cancels: set[str] = field(default_factory=set)  # ids to cancel at the next step boundary
    live: dict[str, Request] = field(default_factory=dict)  # submitted and without a final output yet
    accepting: bool = True  # submissions are taken (False after stop() or the thread's death)
    stop_requested: bool = False  # the loop ends once the queue is done
    hard_stop: bool = False  # the loop ends at the next step boundary, failing what is left
    pause_requests: int = 0  # callers inside `pause()`
    paused: bool = False  # the loop holds between two steps
    # Weight updates: the check the loop owes (applied once no `pause()` holds it, before the next step),
    # the tickets handed out and the last one applied (a pause's end waits for its own).
    weight_check: WeightCheck | None = None
    weight_tickets: int = 0
    weight_checked: int = 0
    # `release_cache()`: the caller's wish (until `resume_cache()`), and what the release freed while it holds.
    release_requested: bool = False
    released_cache: ReleasedCache | None = None
    destroyed: bool = False
    release_on_exit: bool = False  # a non-blocking destroy(): the thread releases the engine
    thread_status: BackgroundThreadStatus = field(default_factory=BackgroundThreadStatus)
    counts: dict[RequestStatus, int] = field(default_factory=lambda: dict.fromkeys(COUNTED_STATUSES, 0))

    def take_submissions(self) -> tuple[list[Request], set[str]]:
        """Empty the incoming queue and the cancellations and return them (lock held by the caller)."""
        incoming, self.incoming = list(self.incoming), deque()
        cancels, self.cancels = self.cancels, set()
        return incoming, cancels

    def owe_weight_check(self, mode: UpdateMode, changed: bool) -> int:
        """Record a weight check for the loop (merged into one already owed); returns its ticket (lock
        held by the caller)."""
        self.weight_tickets += 1
        ticket = self.weight_tickets
        owed = self.weight_check
        self.weight_check = (
            WeightCheck(mode, changed, ticket) if owed is None else owed.merged(mode, changed, ticket)
        )
        return ticket

    def num_waiting(self) -> int:
        """Requests not scheduled yet: queued here or waiting in the engine (lock held by the caller)."""
        return len(self.incoming) + (self.engine.num_waiting if self.engine is not None else 0)
