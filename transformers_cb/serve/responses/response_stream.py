"""The Responses API's output from one choice's events: gathered whole (`collect_output`) or as the stream's
numbered server-sent events (`response_stream`); the items themselves are response_output.py's `OutputItems`."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from ..events.choices import ChoiceEvent, aclose
from .response_output import OutputItems
from .responses_api import ResponseObject, sse_event


async def collect_output(events: AsyncIterator[ChoiceEvent]) -> OutputItems:
    """One choice's `events` gathered into output items (a whole, not streamed, response)."""
    output = OutputItems()
    try:
        async for event in events:
            if event.error is not None:
                raise event.error
            output.add(event)
        output.finish()
    finally:
        await aclose(events)
    return output


async def response_stream(
    shape: ResponseObject, events: AsyncIterator[ChoiceEvent], finished: Callable[[OutputItems], None]
) -> AsyncIterator[bytes]:
    """The Responses API's server-sent events for one choice's `events` (created, in progress, the output
    items' deltas, then completed / incomplete, or error and failed); `finished` gets the output of a response
    that ended without an error (app.py stores it for `previous_response_id`)."""
    output = OutputItems()
    sequence = 0

    def numbered(event: dict[str, object]) -> bytes:
        nonlocal sequence
        sequence += 1
        return sse_event(event, sequence - 1)

    try:
        yield numbered({"type": "response.created", "response": shape.render(None, "in_progress")})
        yield numbered({"type": "response.in_progress", "response": shape.render(None, "in_progress")})
        async for event in events:
            if event.error is not None:
                error = event.error
                yield numbered(
                    {"type": "error", "code": error.code, "message": error.message, "param": error.param}
                )
                yield numbered({"type": "response.failed", "response": shape.render(output, "failed", error)})
                return
            for step in output.add(event):
                yield numbered(step)
        for step in output.finish():
            yield numbered(step)
        finished(output)
        kind = "response.completed" if output.status == "completed" else "response.incomplete"
        yield numbered({"type": kind, "response": shape.render(output, output.status)})
    finally:
        await aclose(events)
