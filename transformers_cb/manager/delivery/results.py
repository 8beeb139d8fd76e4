"""Routing outputs from the manager thread to whoever waits for them.

Rules, which make "every output delivered exactly once, in order" checkable:
- Each live request has a *route*. Its outputs (partial ones when streaming, then the final one)
  enter the route in production order and leave it exactly once.
- An **unclaimed** request's outputs go to the shared queue read by `get_result()` and by iterating
  the manager: a streaming request's partial outputs first, in order, then its final one.
- A request is **claimed** by iterators (`request_id_iter`, `stream`) or by a handler
  (`register_result_handler`). A claim first takes back, in order, the outputs of that request still
  waiting in the shared queue; from then on its outputs go only to the claimant.
- Iterators *pull* from the route's outbox, which lives here and not in the iterator: an iterator
  dropped after one output loses nothing, and the next one resumes at the first output not yet
  delivered. Two live iterators on one request share it: each output goes to one of them, and once
  the final one is taken, the others end.
- A handler is *pushed* to, one output at a time and in order, never concurrently: by the thread
  that registered it inside a running event loop, on that loop (`call_soon_threadsafe`); otherwise on
  the manager thread (or, when the manager is not running, on the registering thread).
- A handler registered before its request is submitted is kept by id and attached at submission.

The route of a request disappears when its final output is delivered; the id is then unknown here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ...requests import GenerationOutput

logger = logging.getLogger(__name__)

Deliver = Callable[[GenerationOutput], None]


class ManagerDeadError(RuntimeError):
    """The manager's background thread died; nothing more will be produced."""


class UnknownRequestError(KeyError, ValueError):
    """No live request has this id, or every output of it was already delivered.

    A `KeyError` (a lookup by id failed) and, for code written against earlier releases, a `ValueError`.
    """

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def unknown_request(request_id: str) -> UnknownRequestError:
    return UnknownRequestError(
        f"unknown request id {request_id!r}: never submitted, or all its outputs (its final one "
        "included) were already delivered"
    )


class NotRunningError(RuntimeError):
    """A caller waits for an output that no thread can produce: the manager is not running."""


@dataclass(eq=False)
class _Route:
    request_id: str
    streaming: bool
    outbox: deque[GenerationOutput] = field(default_factory=deque)  # produced, not delivered yet
    iterated: bool = False  # claimed by iterators (pull)
    handler: Deliver | None = None  # claimed by a handler (push)
    loop: asyncio.AbstractEventLoop | None = None  # where the handler runs, if registered in a loop
    draining: bool = False  # a handler delivery is scheduled or under way
    final_produced: bool = False
    final_delivered: bool = False
    wakers: list[Callable[[], None]] = field(default_factory=list)  # async iterators waiting

    @property
    def claimed(self) -> bool:
        return self.iterated or self.handler is not None


class ResultRouter:
    """Thread-safe mailbox between the manager thread (producer) and callers (consumers)."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._results: deque[GenerationOutput] = deque()  # the shared queue
        self._routes: dict[str, _Route] = {}
        self._early: dict[str, tuple[Deliver, asyncio.AbstractEventLoop | None]] = {}
        self._to_drain: list[_Route] = []  # handler deliveries handed to the manager thread
        self._dead: BaseException | None = None
        self._closed = True  # no producer runs until `set_closed(False)` (the manager's start)

    # -- producer side ---------------------------------------------------------------
    def expect(self, request_id: str, streaming: bool) -> None:
        with self._cv:
            route = self._routes[request_id] = _Route(request_id, streaming)
            early = self._early.pop(request_id, None)
            if early is not None:
                route.handler, route.loop = early

    def ids_in_use(self) -> set[str]:
        """Ids with outputs not all delivered yet: a new submission may not reuse them."""
        with self._cv:
            return set(self._routes)

    def drop_early_handler(self, request_id: str) -> None:
        """A submission under this id was refused: forget a handler registered for it in advance."""
        with self._cv:
            self._early.pop(request_id, None)

    def publish(self, output: GenerationOutput) -> None:
        """Route a partial (non-final status) or final output. Never raises."""
        with self._cv:
            route = self._routes.get(output.request_id)
            if route is None or route.final_produced:
                return
            if output.status.is_finished:
                route.final_produced = True
            elif not route.streaming:
                return
            if route.claimed:
                route.outbox.append(output)
            else:
                self._results.append(output)
            action = self._start_drain(route, on_caller=True)
            wakers = list(route.wakers)
            self._cv.notify_all()
        _run_outside_lock(action, wakers)

    def drain_handed_over(self) -> None:
        """Deliver backlogs that callers handed to the manager thread (called by that thread)."""
        with self._cv:
            routes, self._to_drain = self._to_drain, []
        for route in routes:
            self._drain(route)

    def mark_dead(self, error: BaseException) -> None:
        with self._cv:
            self._dead = error
            self._cv.notify_all()

    def set_closed(self, closed: bool) -> None:
        """Closed: no producer runs (not started, stopped or dead), so waiting forever is pointless.
        Closing delivers the backlogs handed to the manager thread, which will not do it any more."""
        with self._cv:
            self._closed = closed
            routes, self._to_drain = (self._to_drain, []) if closed else ([], self._to_drain)
            wakers = [w for route in self._routes.values() for w in route.wakers]
            self._cv.notify_all()
        for route in routes:
            self._drain(route)
        _run_outside_lock(None, wakers)

    @property
    def closed(self) -> bool:
        with self._cv:
            return self._closed

    @property
    def dead(self) -> BaseException | None:
        with self._cv:
            return self._dead

    # -- handlers (push) ------------------------------------------------------------------
    def register_handler(self, request_id: str, deliver: Deliver) -> None:
        """Push `request_id`'s outputs to `deliver` (see the module docstring for on which thread)."""
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        with self._cv:
            route = self._routes.get(request_id)
            if route is None:
                self._early[request_id] = (deliver, loop)
                return
            if route.iterated:
                raise ValueError(f"request {request_id!r} is already claimed by request_id_iter/stream")
            self._take_back(route)
            route.handler, route.loop = deliver, loop
            action = self._start_drain(route, on_caller=False)
        _run_outside_lock(action, [])

    def _start_drain(self, route: _Route, on_caller: bool) -> Callable[[], None] | None:
        """Under the lock: if `route` has a handler, undelivered outputs and no delivery under way, claim
        the delivery and return what starts it (to run outside the lock). `on_caller`: the caller is the
        manager thread (or a thread that may deliver); otherwise hand over to the manager thread."""
        if route.handler is None or route.draining or not route.outbox:
            return None
        route.draining = True
        loop = route.loop
        if loop is not None:
            return lambda: self._schedule_on_loop(loop, route)
        if on_caller or self._closed:
            return lambda: self._drain(route)
        self._to_drain.append(route)
        self._cv.notify_all()
        return None

    def _schedule_on_loop(self, loop: asyncio.AbstractEventLoop, route: _Route) -> None:
        try:
            loop.call_soon_threadsafe(self._drain, route)
        except RuntimeError:  # the loop is closed: nobody can receive these outputs any more
            logger.warning(
                "event loop of the handler for %r is closed; its outputs are dropped", route.request_id
            )
            with self._cv:
                route.outbox.clear()
                route.draining = False
                route.final_delivered = route.final_produced
                if route.final_produced and self._routes.get(route.request_id) is route:
                    del self._routes[route.request_id]

    def _drain(self, route: _Route) -> None:
        """Deliver `route`'s outbox in order, one output at a time (only one drain runs per route)."""
        while True:
            with self._cv:
                if not route.outbox:
                    route.draining = False
                    return
                output = route.outbox.popleft()
                handler = route.handler
                if output.status.is_finished:
                    self._final_delivered(route)
            _safe_call(handler, output)

    # -- iterators (pull) ------------------------------------------------------------------
    def open_iterator(self, request_id: str) -> _Route:
        """Claim `request_id` for iterators; `UnknownRequestError` if nothing of it is left to deliver."""
        with self._cv:
            route = self._routes.get(request_id)
            if route is None:
                raise unknown_request(request_id)
            if route.handler is not None:
                raise ValueError(f"request {request_id!r} is already claimed by a result handler")
            self._take_back(route)
            route.iterated = True
            return route

    def poll(self, route: _Route, timeout: float | None) -> GenerationOutput | None:
        """The next undelivered output of `route`; None once its final one went to another iterator, or
        (with a `timeout`) when none came in time. Raises `ManagerDeadError` / `NotRunningError` when
        no thread can produce the next one."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while True:
                if route.outbox:
                    output = route.outbox.popleft()
                    if output.status.is_finished:
                        self._final_delivered(route)
                    return output
                if route.final_delivered:
                    return None
                self._raise_if_unproducible(f"request {route.request_id!r}")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError
                self._cv.wait(0.5 if remaining is None else min(remaining, 0.5))

    def add_waker(self, route: _Route, waker: Callable[[], None]) -> None:
        with self._cv:
            route.wakers.append(waker)

    def remove_waker(self, route: _Route, waker: Callable[[], None]) -> None:
        with self._cv:
            if waker in route.wakers:
                route.wakers.remove(waker)

    # -- the shared queue ------------------------------------------------------------------
    def get(self, request_id: str | None = None, timeout: float | None = None) -> GenerationOutput | None:
        """The next output in the shared queue (with `request_id`: the next one of that request; the
        others stay in place). None on timeout, or at once when no such output can arrive any more.

        Raises `ManagerDeadError` when the manager thread died and nothing is left, `NotRunningError`
        when, without `timeout`, outputs are outstanding but the manager is not running.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while True:
                output = self._pop_shared(request_id)
                if output is not None:
                    return output
                if self._dead is not None:
                    raise ManagerDeadError(f"the manager thread died: {self._dead!r}") from self._dead
                if not self._awaits_shared(request_id):
                    return None
                if self._closed and deadline is None:
                    what = "unclaimed requests are" if request_id is None else f"request {request_id!r} is"
                    raise NotRunningError(
                        f"{what} outstanding but the manager is not running (never started, stopped or "
                        "destroyed): call start(), or pass a timeout"
                    )
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._cv.wait(0.5 if remaining is None else remaining)

    def num_shared(self) -> int:
        """Outputs waiting in the shared queue now."""
        with self._cv:
            return len(self._results)

    def requeue(self, output: GenerationOutput) -> None:
        """Put an output taken from the shared queue back at its end (manager/compat.py's `put`)."""
        with self._cv:
            self._results.append(output)
            self._cv.notify_all()

    def has_unclaimed_work(self) -> bool:
        """True while some output may still arrive in (or is in) the shared queue."""
        with self._cv:
            return bool(self._results) or self._awaits_shared(None)

    def check_alive(self) -> None:
        with self._cv:
            if self._dead is not None:
                raise ManagerDeadError(f"the manager thread died: {self._dead!r}") from self._dead

    # -- internals (lock held) ---------------------------------------------------------------
    def _pop_shared(self, request_id: str | None) -> GenerationOutput | None:
        if request_id is None:
            output = self._results.popleft() if self._results else None
        else:
            output = next((o for o in self._results if o.request_id == request_id), None)
            if output is not None:
                self._results.remove(output)
        if output is not None and output.status.is_finished:
            route = self._routes.get(output.request_id)
            if route is not None and not route.claimed:
                self._final_delivered(route)
        return output

    def _awaits_shared(self, request_id: str | None) -> bool:
        if request_id is not None:
            route = self._routes.get(request_id)
            return route is not None and not route.claimed and not route.final_produced
        return any(not r.claimed and not r.final_produced for r in self._routes.values())

    def _take_back(self, route: _Route) -> None:
        """Move `route`'s outputs still in the shared queue to its outbox, in order."""
        if route.claimed:
            return
        mine = [o for o in self._results if o.request_id == route.request_id]
        if mine:
            self._results = deque(o for o in self._results if o.request_id != route.request_id)
            route.outbox.extend(mine)

    def _final_delivered(self, route: _Route) -> None:
        route.final_delivered = True
        if self._routes.get(route.request_id) is route:
            del self._routes[route.request_id]
        self._cv.notify_all()

    def _raise_if_unproducible(self, what: str) -> None:
        if self._dead is not None:
            raise ManagerDeadError(f"the manager thread died: {self._dead!r}") from self._dead
        if self._closed:
            raise NotRunningError(
                f"{what} has no further output yet and the manager is not running (never started, stopped "
                "or destroyed): call start()"
            )


def _run_outside_lock(action: Callable[[], None] | None, wakers: list[Callable[[], None]]) -> None:
    if action is not None:
        action()
    for wake in wakers:
        with contextlib.suppress(RuntimeError):  # an async iterator whose loop is closed: nothing to wake
            wake()


def _safe_call(deliver: Deliver | None, output: GenerationOutput) -> None:
    if deliver is None:
        return
    try:
        deliver(output)
    except Exception:  # noqa: BLE001 - a user callback must never kill the manager thread
        logger.exception("result handler for %r raised", output.request_id)
