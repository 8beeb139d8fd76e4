"""One OpenAI "choice" = one manager request: submit it, stream its tokens as text events, cancel it.

Every choice is submitted with `streaming=True` (also for non-streaming HTTP
requests), so stop strings are found as tokens arrive and the request is
cancelled at once instead of generating to `max_tokens`. Tokens arrive through
`manager.stream(rid)`, the manager's asyncio iterator: no polling.

Sampling: OpenAI's default is `temperature=1`, so a request samples unless it
sends `temperature=0` (greedy: with nothing else that changes its logits it
costs the engine what a greedy engine costs, `request.sampling is None`). The
server's engine is built with every per-request processor stage
(`all_request_stages`), each neutral unless a request gives its value;
`ManagerChoices.options` passes the values a request gives.

The endpoints (app.py) hand every choice to one `ManagerChoices`, which holds the server's manager: the
options a choice is submitted with, its submission, its events and its cancellation all go through it, so
the manager is asked in one place and the app never threads it through.
"""

from __future__ import annotations

import asyncio
import queue
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from transformers import GenerationConfig

from ...manager.delivery.results import ManagerDeadError
from ...requests import RequestStatus
from ...sampling.neutral import NEUTRAL_VALUES, is_neutral
from ...sampling.params import VECTOR_PARAMS, derive_seed
from ..chat.tools import ToolCall
from ..metrics import ServerMetrics
from ..protocol import ApiError
from .text import IncrementalDetokenizer, StopScanner

if TYPE_CHECKING:
    from ...manager.manager import ContinuousBatchingManager
    from ...requests import GenerationOutput


def serving_generation_config(eos_token_id: Any, pad_token_id: Any) -> GenerationConfig:
    """The server engine's GenerationConfig: sampling on (OpenAI's default `temperature=1`), the
    model's special ids, and the per-request processors at their neutral values, so that the model's
    own sampling defaults never reach the server's requests. The engine is built with
    `all_request_stages`: every request brings its own values (neutral when it gives none)."""
    neutral = {name: NEUTRAL_VALUES[name] for name in VECTOR_PARAMS}
    return GenerationConfig(do_sample=True, eos_token_id=eos_token_id, pad_token_id=pad_token_id, **neutral)


@dataclass
class ChoiceEvent:
    """New text (and the tokens behind it) for choice `index`; the last one has `finish_reason` or `error`."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)  # None: the engine gave none
    top_logprobs: list[dict[int, float] | None] = field(default_factory=list)  # with top_logprobs > 0
    echoed: int = 0  # how many leading `token_ids` are the echoed prompt (echo=true)
    finish_reason: str | None = None
    error: ApiError | None = None
    # Chat only, once the text is split (serve/chat/turn.py): `text` is then the content.
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    @property
    def is_last(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.echoed


@dataclass(frozen=True)
class ChoiceOptions:
    """What the choices of one HTTP request share besides their prompt."""

    sampling: dict[str, Any]  # `add_request` keywords, checked by it (the per-request kwargs are open)
    seed: int | None = None
    eos_token_id: list[int] | None = None  # None: the engine's
    max_tokens: int | None = None  # what the client may receive (0: the echoed prompt only)
    stops: tuple[str, ...] = ()
    want_logprobs: bool = False
    top_logprobs: int = 0
    echo: bool = False
    adapter: str | None = (
        None  # the PEFT adapter (the `model` field, serve/served_adapters.py); None: the base model
    )


@dataclass
class Submitted:
    """A submitted choice. Its outputs are claimed (`stream`) at submission, so none can ever land in
    the manager's shared result queue, which nobody reads in a server."""

    request_id: str
    index: int
    stream: AsyncIterator[GenerationOutput]
    submitted_at: float
    over: bool = False  # final output seen, or cancelled by us


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice 0 samples with the request's seed, choice i > 0 with one derived from it: `n` seeded
    choices differ from each other and are the same on every call."""
    if seed is None or index == 0:
        return seed
    return derive_seed(seed, f"choice-{index}")


@dataclass
class ManagerChoices:
    """The server's manager (started; never stopped here) as the endpoints use it: what a choice is
    submitted with, its submission, its events, its cancellation."""

    manager: ContinuousBatchingManager

    def options(
        self,
        chosen: dict[str, object],
        temperature: float | None,
        seed: int | None,
        ignore_eos: bool,
        stop_token_ids: list[int] | None,
        max_tokens: int | None,
        stops: tuple[str, ...],
        want_logprobs: bool,
        top_logprobs: int,
        echo: bool,
    ) -> ChoiceOptions:
        """What every choice of one HTTP request is submitted with (`chosen`: its non-neutral body fields
        as `add_request` keywords)."""
        return ChoiceOptions(
            sampling=self._sampling_kwargs(temperature, chosen),
            seed=seed,
            eos_token_id=self._eos_token_ids(ignore_eos, stop_token_ids),
            max_tokens=max_tokens,
            stops=stops,
            want_logprobs=want_logprobs,
            top_logprobs=top_logprobs,
            echo=echo,
        )

    def _sampling_kwargs(self, temperature: float | None, chosen: dict[str, object]) -> dict[str, object]:
        """Per-request sampling arguments for `manager.add_request`: `chosen` and temperature as OpenAI
        means it (absent: 1; 0: greedy). What a request does not give is neutral in the server's engine
        (`all_request_stages`). A value the engine cannot take is refused by it at submission (a 400)."""
        config = self._generation_config()
        default_sample = bool(config is not None and config.do_sample)
        temperature = 1.0 if temperature is None else temperature
        kwargs = dict(chosen)
        if temperature > 0 and not is_neutral("temperature", temperature):
            kwargs["temperature"] = temperature
        if (temperature > 0) != default_sample:
            kwargs["do_sample"] = temperature > 0
        return kwargs

    def _eos_token_ids(self, ignore_eos: bool, stop_token_ids: list[int] | None) -> list[int] | None:
        """The eos ids of a request: the engine's plus `stop_token_ids`; only the latter with `ignore_eos`."""
        if not ignore_eos and not stop_token_ids:
            return None
        ids = list(stop_token_ids or ())
        config = self._generation_config()
        if not ignore_eos and config is not None and config.eos_token_id is not None:
            eos = config.eos_token_id
            ids = [*(eos if isinstance(eos, list) else [eos]), *ids]
        return ids

    def _generation_config(self) -> GenerationConfig | None:
        engine = self.manager.engine
        return None if engine is None else engine.settings.sampling.generation_config

    def submit(
        self, prompts: Sequence[list[int]], n: int, options: ChoiceOptions, id_prefix: str
    ) -> list[Submitted]:
        """Submit `n` requests per prompt (choice index = prompt * n + j). All or nothing: on any
        refusal the ones already submitted are cancelled and an `ApiError` is raised."""
        manager = self.manager
        submitted: list[Submitted] = []
        # max_tokens=0 (echo only) still runs the prefill; its one token is dropped (`_ChoiceText`).
        max_new_tokens = 1 if options.max_tokens == 0 else options.max_tokens
        try:
            for p, prompt in enumerate(prompts):
                for j in range(n):
                    index = p * n + j
                    seed = choice_seed(options.seed, index)
                    seeded: dict[str, Any] = {} if seed is None else {"seed": seed}
                    request_id = manager.add_request(
                        prompt,
                        request_id=f"{id_prefix}-{index}",
                        max_new_tokens=max_new_tokens,
                        streaming=True,
                        eos_token_id=options.eos_token_id,
                        adapter=options.adapter,
                        **options.sampling,
                        **seeded,
                    )
                    if request_id is None:
                        raise ApiError(503, "the server is shutting down and accepts no new requests")
                    stream = manager.stream(request_id)
                    submitted.append(Submitted(request_id, index, stream, time.perf_counter()))
        except BaseException as error:
            self.cancel_unfinished(submitted)
            raise _as_api_error(error, {**options.sampling, "seed": options.seed}) from error
        return submitted

    def cancel_unfinished(self, submitted: list[Submitted]) -> None:
        """Cancel every choice whose request has not ended (client gone, error, shutdown). Idempotent."""
        for choice in submitted:
            if not choice.over:
                choice.over = True
                self.manager.cancel_request(choice.request_id)

    async def events(
        self,
        choice: Submitted,
        tokenizer: Any,
        options: ChoiceOptions,
        metrics: ServerMetrics,
        echo: tuple[str, list[int]] | None = None,
    ) -> AsyncIterator[ChoiceEvent]:
        """Text events of one choice, ending with one event that carries `finish_reason` or `error`.

        Closing the generator early (client gone, stop string, shutdown) cancels the manager request.
        """
        scanner = StopScanner(list(options.stops))
        text = _ChoiceText(choice, IncrementalDetokenizer(tokenizer), scanner, options, metrics, echo)
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
            self.cancel_unfinished([choice])
            await aclose(choice.stream)


def _as_api_error(error: BaseException, sampling: dict[str, object]) -> BaseException:
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
    """Turns one choice's successive outputs into events, reading only what each brings new
    (`new_tokens`, `new_logprobs`, `new_top_logprobs`): O(1) per token however long the stream.

    `echo`: the prompt (its text and ids) to send before the first generated token."""

    choice: Submitted
    detokenizer: IncrementalDetokenizer
    scanner: StopScanner
    options: ChoiceOptions
    metrics: ServerMetrics
    echo: tuple[str, list[int]] | None = None
    seen: int = 0
    last_arrival: float | None = None

    def take(self, output: Any) -> ChoiceEvent:
        limit = self.options.max_tokens
        new_ids = output.new_tokens
        if limit is not None:
            new_ids = new_ids[: max(limit - self.seen, 0)]
        new_logprobs = output.new_logprobs or []
        new_tops = output.new_top_logprobs or []
        self.seen += len(new_ids)
        self._observe_latency(len(new_ids))
        event = ChoiceEvent(self.choice.index)
        if self.echo is not None and (new_ids or output.status.is_finished):
            self._add_echo(event, output, self.echo)
        for k, token_id in enumerate(new_ids):
            event.token_ids.append(token_id)
            if self.options.want_logprobs:
                event.logprobs.append(new_logprobs[k] if k < len(new_logprobs) else None)
                if self.options.top_logprobs:
                    event.top_logprobs.append(new_tops[k] if k < len(new_tops) else None)
            event.text += self.scanner.push(self.detokenizer.push(token_id))
            if self.scanner.stopped:
                event.finish_reason = "stop"  # later tokens (same output) are dropped, as OpenAI does
                return event
        if output.status.is_finished:
            _finish(event, output, self.scanner, self.detokenizer)
            if limit == 0 and event.error is None:
                event.finish_reason = "length"  # max_tokens=0: the engine's one token is not the client's
        return event

    def _add_echo(self, event: ChoiceEvent, output: Any, echo: tuple[str, list[int]]) -> None:
        text, ids = echo
        self.echo = None
        event.text, event.token_ids, event.echoed = text, list(ids), len(ids)
        if self.options.want_logprobs:
            event.logprobs = list(output.prompt_logprobs or [None] * len(ids))
            if self.options.top_logprobs:
                event.top_logprobs = list(output.prompt_top_logprobs or [None] * len(ids))

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
    elif output.status == RequestStatus.ABORTED:
        event.error = ApiError(503, f"the request was aborted by a weight update: {output.error}")
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
            item = await mailbox.get()
            if item is None:
                remaining -= 1
                continue
            yield item
        for task in tasks:
            task.result()  # re-raise a pump's unexpected exception
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def aclose(stream: AsyncIterator[object]) -> None:
    """Close an async generator now (leaving an `async for` early does not close it)."""
    close = getattr(stream, "aclose", None)
    if close is not None:
        await close()
