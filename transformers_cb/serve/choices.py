"""One OpenAI "choice" = one manager request: submit it, stream its tokens as text events, cancel it.

Every choice is submitted with `streaming=True` (also for non-streaming HTTP
requests), so stop strings are found as tokens arrive and the request is
cancelled at once instead of generating to `max_tokens`. Tokens arrive through
`manager.stream(rid)`, the manager's asyncio iterator: no polling.
"""

from __future__ import annotations

import asyncio
import inspect
import queue
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..manager.results import ManagerDeadError
from ..requests import RequestStatus
from .metrics import ServerMetrics
from .protocol import ApiError
from .text import IncrementalDetokenizer, StopScanner


@dataclass
class ChoiceEvent:
    """New text (and the tokens behind it) for choice `index`; the last one has `finish_reason` or `error`."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)  # None: the engine gave none
    finish_reason: str | None = None
    error: ApiError | None = None

    @property
    def is_last(self) -> bool:
        return self.finish_reason is not None or self.error is not None


@dataclass
class Submitted:
    """A submitted choice. Its outputs are claimed (`stream`) at submission, so none can ever land in
    the manager's shared result queue, which nobody reads in a server."""

    request_id: str
    index: int
    stream: AsyncIterator[Any]
    submitted_at: float
    over: bool = False  # final output seen, or cancelled by us


def cancel_unfinished(manager: Any, submitted: list[Submitted]) -> None:
    """Cancel every choice whose request has not ended (client gone, error, shutdown). Idempotent."""
    for choice in submitted:
        if not choice.over:
            choice.over = True
            manager.cancel_request(choice.request_id)


def sampling_kwargs(
    manager: Any,
    temperature: float | None,
    top_p: float | None,
    top_k: int | None,
    seed: int | None,
) -> dict[str, Any]:
    """Per-request sampling arguments for `manager.add_request`, neutral values left out.

    A parameter the manager's `add_request` does not take is a 400 naming it: never ignored.
    """
    chosen: dict[str, Any] = {}
    if temperature is not None and not (temperature == 0.0 and not _samples_by_default(manager)):
        chosen["temperature"] = temperature
    if top_p is not None and top_p != 1.0:
        chosen["top_p"] = top_p
    if top_k is not None and top_k not in (0, -1):
        chosen["top_k"] = top_k
    if seed is not None:
        chosen["seed"] = seed
    accepted = inspect.signature(manager.add_request).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    for name in chosen:
        if name not in accepted and not takes_any:
            raise ApiError(
                400, f"{name}: per-request {name} is not supported by this engine build", param=name
            )
    return chosen


def _samples_by_default(manager: Any) -> bool:
    engine = getattr(manager, "engine", None)
    return bool(engine is not None and engine.generation_config.do_sample)


def submit_choices(
    manager: Any,
    prompts: Sequence[list[int]],
    n: int,
    max_new_tokens: int | None,
    sampling: dict[str, Any],
    id_prefix: str,
) -> list[Submitted]:
    """Submit `n` requests per prompt (choice index = prompt * n + j). All or nothing: on any
    refusal the ones already submitted are cancelled and an `ApiError` is raised."""
    submitted: list[Submitted] = []
    try:
        for p, prompt in enumerate(prompts):
            for j in range(n):
                index = p * n + j
                request_id = manager.add_request(
                    prompt,
                    request_id=f"{id_prefix}-{index}",
                    max_new_tokens=max_new_tokens,
                    streaming=True,
                    **sampling,
                )
                if request_id is None:
                    raise ApiError(503, "the server is shutting down and accepts no new requests")
                stream = manager.stream(request_id)
                submitted.append(Submitted(request_id, index, stream, time.perf_counter()))
    except BaseException as error:
        cancel_unfinished(manager, submitted)
        raise _as_api_error(error, sampling) from error
    return submitted


def _as_api_error(error: BaseException, sampling: dict[str, Any]) -> BaseException:
    if isinstance(error, ApiError):
        return error
    if isinstance(error, ImportError) and "guided" in sampling:
        # Structured outputs without the `structured` extra: the message names it.
        return ApiError(400, str(error), param="guided")
    if isinstance(error, queue.Full):
        return ApiError(429, f"the request queue is full, retry later ({error})", code="queue_full")
    if isinstance(error, (NotImplementedError, TypeError)) and sampling:
        # Sampling parameters the engine does not take (TypeError) or has not built (NotImplementedError).
        named = [name for name in sampling if name in str(error)] or list(sampling)
        return ApiError(
            400, f"{', '.join(named)}: not supported by this engine build ({error})", param=named[0]
        )
    if isinstance(error, ValueError):
        # A refused per-request sampling parameter (e.g. without per_request_processors) names itself.
        named = [name for name in sampling if name in str(error)]
        return ApiError(400, str(error), param=named[0] if named else None)
    if isinstance(error, RuntimeError):
        return ApiError(503, f"the engine cannot take requests: {error}")
    return error


@dataclass
class _ChoiceText:
    """Turns one choice's successive outputs (growing `generated_tokens`) into events."""

    choice: Submitted
    detokenizer: IncrementalDetokenizer
    scanner: StopScanner
    want_logprobs: bool
    metrics: ServerMetrics
    seen: int = 0
    last_arrival: float | None = None

    def take(self, output: Any) -> ChoiceEvent:
        new_ids = output.generated_tokens[self.seen :]
        new_logprobs = (output.logprobs or [])[self.seen :]
        self.seen += len(new_ids)
        self._observe_latency(len(new_ids))
        event = ChoiceEvent(self.choice.index)
        for k, token_id in enumerate(new_ids):
            event.token_ids.append(token_id)
            if self.want_logprobs:
                event.logprobs.append(new_logprobs[k] if k < len(new_logprobs) else None)
            event.text += self.scanner.push(self.detokenizer.push(token_id))
            if self.scanner.stopped:
                event.finish_reason = "stop"  # later tokens (same output) are dropped, as OpenAI does
                return event
        if output.status.is_finished:
            _finish(event, output, self.scanner, self.detokenizer)
        return event

    def _observe_latency(self, num_new: int) -> None:
        if not num_new:
            return
        now = time.perf_counter()
        if self.last_arrival is None:
            self.metrics.ttft.observe(now - self.choice.submitted_at)
        else:
            for _ in range(num_new):
                self.metrics.itl.observe((now - self.last_arrival) / num_new)
        self.last_arrival = now


async def choice_events(
    manager: Any,
    choice: Submitted,
    tokenizer: Any,
    stops: list[str],
    want_logprobs: bool,
    metrics: ServerMetrics,
) -> AsyncIterator[ChoiceEvent]:
    """Text events of one choice, ending with one event that carries `finish_reason` or `error`.

    Closing the generator early (client gone, stop string, shutdown) cancels the manager request.
    """
    text = _ChoiceText(choice, IncrementalDetokenizer(tokenizer), StopScanner(stops), want_logprobs, metrics)
    try:
        async for output in choice.stream:
            choice.over = choice.over or output.status.is_finished
            event = text.take(output)
            if event.text or event.token_ids or event.is_last:
                yield event
            if event.is_last:
                return
    except ManagerDeadError as error:
        choice.over = True  # nothing left to cancel
        yield ChoiceEvent(
            choice.index, error=ApiError(500, f"the engine stopped: {error}", code="engine_error")
        )
    finally:
        cancel_unfinished(manager, [choice])
        await aclose(choice.stream)


def _finish(
    event: ChoiceEvent, output: Any, scanner: StopScanner, detokenizer: IncrementalDetokenizer
) -> None:
    """Fill the last event of a request that ended in the engine."""
    if output.status == RequestStatus.FINISHED:
        event.text += scanner.push(detokenizer.flush())
        if not scanner.stopped:
            event.text += scanner.flush()
        stopped_here = scanner.stopped or output.finish_reason != "length"
        event.finish_reason = "stop" if stopped_here else "length"
    elif output.status == RequestStatus.CANCELLED:
        event.error = ApiError(503, f"the request was cancelled by the server: {output.error}")
    else:
        event.error = ApiError(500, f"generation failed: {output.error}", code="engine_error")


async def merge_events(streams: list[AsyncIterator[ChoiceEvent]]) -> AsyncIterator[ChoiceEvent]:
    """Interleave the events of several choices as they arrive. Closing it closes every stream."""
    if len(streams) == 1:
        try:
            async for event in streams[0]:
                yield event
        finally:
            await aclose(streams[0])
        return
    mailbox: asyncio.Queue[ChoiceEvent | None] = asyncio.Queue()

    async def pump(stream: AsyncIterator[ChoiceEvent]) -> None:
        try:
            async for event in stream:
                mailbox.put_nowait(event)
        finally:
            mailbox.put_nowait(None)

    tasks = [asyncio.ensure_future(pump(stream)) for stream in streams]
    try:
        remaining = len(tasks)
        while remaining:
            event = await mailbox.get()
            if event is None:
                remaining -= 1
                continue
            yield event
        for task in tasks:
            task.result()  # re-raise a pump's unexpected exception
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def aclose(stream: AsyncIterator[Any]) -> None:
    """Close an async generator now (leaving an `async for` early does not close it)."""
    close = getattr(stream, "aclose", None)
    if close is not None:
        await close()
