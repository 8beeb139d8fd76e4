"""Routing outputs from the manager thread to whoever waits for them.

Rules, which make "exactly one final result per request" checkable:
- A request is *claimed* by `request_id_iter`, `stream` (asyncio) or
  `register_result_handler`. A claimed request's outputs (partial ones when
  streaming, then the final one) go only to its claimant.
- The final result of an unclaimed request goes to the shared queue read by
  `get_result()` and by iterating the manager.
- Partial outputs of an unclaimed streaming request are buffered until it is
  claimed, so a claim made late still sees every partial output, then the
  final one. The buffer is dropped when the final result is taken from the
  shared queue instead.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field

from .requests import GenerationOutput

logger = logging.getLogger(__name__)

Deliver = Callable[[GenerationOutput], None]


class ManagerDeadError(RuntimeError):
    """The manager's background thread died; nothing more will be produced."""


@dataclass
class _Pending:
    streaming: bool
    buffer: deque[GenerationOutput] = field(default_factory=deque)
    deliver: Deliver | None = None


class ResultRouter:
    """Thread-safe mailbox between the manager thread (producer) and callers (consumers)."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._results: deque[GenerationOutput] = deque()
        self._pending: dict[str, _Pending] = {}  # submitted, final result not produced yet
        self._late_buffers: dict[str, deque[GenerationOutput]] = {}  # partials of finished unclaimed streams
        self._dead: BaseException | None = None
        self._closed = False

    # -- producer side ---------------------------------------------------------------
    def expect(self, request_id: str, streaming: bool) -> None:
        with self._cv:
            self._pending[request_id] = _Pending(streaming)

    def is_pending(self, request_id: str) -> bool:
        with self._cv:
            return request_id in self._pending

    def num_pending(self) -> int:
        with self._cv:
            return len(self._pending)

    def publish(self, output: GenerationOutput) -> None:
        """Deliver a partial (non-final status) or final output. Never raises."""
        final = output.status.is_finished
        with self._cv:
            pending = self._pending.get(output.request_id)
            if pending is None:
                return
            if final:
                del self._pending[output.request_id]
            deliver = pending.deliver
            if deliver is None:
                if final:
                    self._results.append(output)
                    if pending.buffer:
                        self._late_buffers[output.request_id] = pending.buffer
                elif pending.streaming:
                    pending.buffer.append(output)
            self._cv.notify_all()
        if deliver is not None:
            _safe_call(deliver, output)

    def mark_dead(self, error: BaseException) -> None:
        with self._cv:
            self._dead = error
            self._cv.notify_all()

    def set_closed(self, closed: bool) -> None:
        """Closed: the producer will not run again until restarted, so waiting forever is pointless."""
        with self._cv:
            self._closed = closed
            self._cv.notify_all()

    # -- consumer side ---------------------------------------------------------------
    def claim(self, request_id: str, deliver: Deliver) -> bool:
        """Route `request_id`'s outputs to `deliver` from now on. False if it is unknown or delivered."""
        with self._cv:
            pending = self._pending.get(request_id)
            if pending is not None:
                backlog = list(pending.buffer)
                pending.buffer.clear()
                pending.deliver = deliver
            else:
                finals = [r for r in self._results if r.request_id == request_id]
                if not finals:
                    return False
                self._results.remove(finals[0])
                backlog = [*self._late_buffers.pop(request_id, ()), finals[0]]
        for output in backlog:
            _safe_call(deliver, output)
        return True

    def get(self, request_id: str | None = None, timeout: float | None = None) -> GenerationOutput | None:
        """Next unclaimed final result; with `request_id`, a non-matching head is put back and None returned.

        Raises `ManagerDeadError` when nothing is left and the manager thread died.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while not self._results:
                if self._dead is not None:
                    raise ManagerDeadError(f"the manager thread died: {self._dead!r}") from self._dead
                if self._closed and not self._pending:
                    return None
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._cv.wait(timeout=remaining if remaining is not None else 0.5)
            result = self._results.popleft()
            if request_id is not None and result.request_id != request_id:
                self._results.append(result)
                return None
            self._late_buffers.pop(result.request_id, None)
            return result

    def has_unclaimed_work(self) -> bool:
        """True while some result may still arrive in (or is in) the shared queue."""
        with self._cv:
            return bool(self._results) or any(p.deliver is None for p in self._pending.values())

    def check_alive(self) -> None:
        with self._cv:
            if self._dead is not None:
                raise ManagerDeadError(f"the manager thread died: {self._dead!r}") from self._dead


def _safe_call(deliver: Deliver, output: GenerationOutput) -> None:
    try:
        deliver(output)
    except Exception:  # noqa: BLE001 - a user callback must never kill the manager thread
        logger.exception("result handler for %r raised", output.request_id)


def blocking_channel(router: ResultRouter, request_id: str, poll: float = 0.2) -> Iterator[GenerationOutput]:
    """Claim `request_id` now (`ValueError` if unknown) and return an iterator over its outputs,
    ending after its final one (see `request_id_iter`)."""
    mailbox: queue.SimpleQueue[GenerationOutput] = queue.SimpleQueue()
    if not router.claim(request_id, mailbox.put):
        raise ValueError(
            f"unknown request id {request_id!r} (never submitted, or its result was already taken)"
        )

    def outputs() -> Iterator[GenerationOutput]:
        while True:
            try:
                output = mailbox.get(timeout=poll)
            except queue.Empty:
                router.check_alive()
                continue
            yield output
            if output.status.is_finished:
                return

    return outputs()


def async_channel(
    router: ResultRouter, request_id: str, poll: float = 0.2
) -> AsyncIterator[GenerationOutput]:
    """Claim `request_id` now and return an async iterator over its outputs. Must be called with
    a running event loop (it delivers through `loop.call_soon_threadsafe`)."""
    loop = asyncio.get_running_loop()
    mailbox: asyncio.Queue[GenerationOutput] = asyncio.Queue()

    def deliver(output: GenerationOutput) -> None:
        loop.call_soon_threadsafe(mailbox.put_nowait, output)

    if not router.claim(request_id, deliver):
        raise ValueError(
            f"unknown request id {request_id!r} (never submitted, or its result was already taken)"
        )

    async def outputs() -> AsyncIterator[GenerationOutput]:
        while True:
            try:
                output = await asyncio.wait_for(mailbox.get(), timeout=poll)
            except asyncio.TimeoutError:
                router.check_alive()
                continue
            yield output
            if output.status.is_finished:
                return

    return outputs()
