"""How a generation's events reach the client: the SSE body of a streamed completion, the totals of a
whole one, a client's disconnect watched while they are collected, and the streaming response that cancels
its manager requests however it ends.

Apart from serve/app.py's request flow (body checked, prompt built, choices submitted): what happens here
needs only the events and the client's connection, never the server's state.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from .choices import ChoiceEvent, ManagerChoices, Submitted, aclose
from .completion_bodies import ChoiceTotals, ResponseShape, sse


class CancellingStreamingResponse(StreamingResponse):
    """A streaming response that cancels its manager requests however it ends (even if Starlette
    cancels it before the body iterator ever started)."""

    def __init__(
        self, content: AsyncIterator[bytes], choices: ManagerChoices, submitted: list[Submitted]
    ) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._choices, self._submitted = choices, submitted

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._choices.cancel_unfinished(self._submitted)


async def collect_totals(events: AsyncIterator[ChoiceEvent], indices: list[int]) -> dict[int, ChoiceTotals]:
    totals = {index: ChoiceTotals() for index in indices}
    try:
        async for event in events:
            if event.error is not None:
                raise event.error
            totals[event.index].add(event)
    finally:
        await aclose(events)
    return totals


async def until_disconnect(request: Request, work: Any) -> Any:
    """Run `work`; if the client disconnects first, cancel it and return None."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    gone = True
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        gone = not task.done()
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(watcher, task, return_exceptions=True)
    return None if gone else task.result()


async def _wait_disconnect(request: Request) -> None:
    # The body was read already, so the next ASGI message is the disconnect (or nothing at all).
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def stream_body(
    shape: ResponseShape, events: AsyncIterator[ChoiceEvent], indices: list[int], include_usage: bool
) -> AsyncIterator[bytes]:
    totals = {index: ChoiceTotals() for index in indices}
    try:
        if shape.kind == "chat":
            for index in indices:
                chunk = shape.chunk(ChoiceEvent(index), include_usage, role=True)
                if shape.continuous_usage:
                    chunk["usage"] = shape.usage(totals)
                yield sse(chunk)
        async for event in events:
            if event.error is not None:
                yield sse(event.error.body())
                break
            offset, calls = totals[event.index].text_length, len(totals[event.index].tool_calls)
            totals[event.index].add(event)
            # A token still held back (a partial character, a possible marker) makes no chunk.
            if event.text or event.reasoning or event.tool_calls or event.is_last or shape.want_logprobs:
                chunk = shape.chunk(event, include_usage, text_offset=offset, tool_offset=calls)
                if shape.continuous_usage:
                    chunk["usage"] = shape.usage(totals)
                yield sse(chunk)
        else:
            if include_usage:
                final = shape.chunk(None, include_usage)
                final["usage"] = shape.usage(totals)
                yield sse(final)
        yield sse("[DONE]")
    finally:
        await aclose(events)
