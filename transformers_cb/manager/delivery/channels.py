"""Iterators over one request's outputs: `request_id_iter` (blocking) and `stream` (asyncio); over the
shared queue: `iter(manager)` (`shared_channel`).

Both claim the request at the call and then *pull* from the router, so the position in the stream
lives in the router, not in the iterator: `next(manager.request_id_iter(rid))` in a loop, a new
iterator per chunk as transformers' own tests write it, sees every output exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator

from ...requests import GenerationOutput
from .results import ResultRouter

# How often a waiting async iterator re-checks that the manager can still produce (it is woken at once
# on each output; this only bounds how late it notices a stop or a dead thread).
ASYNC_RECHECK_S = 0.2


def blocking_channel(router: ResultRouter, request_id: str) -> Iterator[GenerationOutput]:
    """Claim `request_id` now (`UnknownRequestError` if nothing of it is left) and return an iterator
    over its undelivered outputs, ending after the final one."""
    route = router.open_iterator(request_id)

    def outputs() -> Iterator[GenerationOutput]:
        while True:
            output = router.poll(route, timeout=None)
            if output is None:  # another iterator took the final output
                return
            yield output
            if output.status.is_finished:
                return

    return outputs()


def async_channel(router: ResultRouter, request_id: str) -> AsyncIterator[GenerationOutput]:
    """Claim `request_id` now and return an async iterator over its undelivered outputs. Must be
    called with a running event loop; the loop is never blocked (it is woken via
    `call_soon_threadsafe`)."""
    loop = asyncio.get_running_loop()
    route = router.open_iterator(request_id)

    async def outputs() -> AsyncIterator[GenerationOutput]:
        ready = asyncio.Event()

        def wake() -> None:
            loop.call_soon_threadsafe(ready.set)

        router.add_waker(route, wake)
        try:
            while True:
                ready.clear()  # before polling: an output published after the poll sets it again
                try:
                    output = router.poll(route, timeout=0)
                except TimeoutError:
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(ready.wait(), ASYNC_RECHECK_S)
                    continue
                if output is None:
                    return
                yield output
                if output.status.is_finished:
                    return
        finally:
            router.remove_waker(route, wake)

    return outputs()


def shared_channel(router: ResultRouter, is_running: Callable[[], bool]) -> Iterator[GenerationOutput]:
    """The shared queue's outputs as they arrive (`iter(manager)`), until nothing unclaimed is outstanding.
    Raises `ManagerDeadError` if the thread died, `RuntimeError` if requests are outstanding but the manager
    is not running (`is_running()`: it would wait forever)."""
    while True:
        result = router.get(timeout=0.1)
        if result is not None:
            yield result
            continue
        if not router.has_unclaimed_work():
            return
        if not is_running():
            router.check_alive()
            if router.has_unclaimed_work():
                raise RuntimeError("requests are outstanding but the manager is not running: call start()")
