"""The FastAPI application: OpenAI-compatible endpoints over one running `ContinuousBatchingManager`.

Request flow: parse and check the body (400/404) -> tokenize -> submit one
manager request per choice (400/429/503 happen here, before any byte is sent)
-> stream the choices' events as SSE, or collect them into one JSON body. A
client that goes away cancels its manager requests (see `ManagerChoices.cancel_unfinished`). Everything
the endpoints ask of the manager goes through the state's one `ManagerChoices` (choices.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..jobs.prompts import rendered_ids, text_ids
from .chat.chat_media import has_media, media_prompt
from .chat.chat_template import chat_text
from .chat.reasoning import template_kwargs, thinks
from .chat.tools import tool_mode
from .chat.turn import TurnFormat, split_events
from .events.choices import ChoiceOptions, ManagerChoices, Submitted, merge_events
from .events.completion_bodies import ResponseShape
from .events.delivery import CancellingStreamingResponse, collect_totals, stream_body, until_disconnect
from .metrics import ServerMetrics
from .protocol import (
    ASSISTANT_FIELDS,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    LoadAdapterRequest,
    parse_body,
)
from .response_format import guided_of
from .responses.response_input import MAX_INPUT_ITEMS, input_messages
from .responses.response_output import OutputItems
from .responses.response_stream import collect_output, response_stream
from .responses.responses_api import (
    ResponseObject,
    ResponsesRequest,
    ResponseStore,
    new_response_id,
    rename_param,
)
from .served_adapters import ServedAdapters

if TYPE_CHECKING:
    from ..manager.manager import ContinuousBatchingManager

logger = logging.getLogger(__name__)


@dataclass
class ServeState:
    """What the endpoints share. `manager` must be started; the app never stops it (`choices`: what the
    endpoints ask of it)."""

    manager: ContinuousBatchingManager
    tokenizer: Any
    model_name: str
    max_positions: int
    default_max_tokens: int = 256  # chat requests without max_tokens
    logprobs: bool = True  # False: `--no-logprobs`, requests asking for them get a 400
    has_assistant: bool = False  # started with `--assistant-model`: requests may set its fields
    reasoning: str = "auto"  # `--reasoning`: on, off, auto (serve/chat/reasoning.py)
    processor: Any = None  # the model's processor: chat messages with images / audio (chat/chat_media.py)
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    stored: ResponseStore = field(default_factory=ResponseStore)  # `previous_response_id`'s conversations
    created: int = field(default_factory=lambda: int(time.time()))
    # `--adapter name=path` and `--max-adapters` (serve/served_adapters.py); None: the base model alone.
    served_adapters: ServedAdapters | None = None
    choices: ManagerChoices = field(init=False)
    adapters: ServedAdapters = field(init=False)  # the `model` field's names

    def __post_init__(self) -> None:
        self.choices = ManagerChoices(self.manager)
        self.adapters = self.served_adapters or ServedAdapters(self.model_name)


def build_openai_app(state: ServeState) -> FastAPI:
    app = FastAPI(title="transformers-cb", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, error: ApiError) -> JSONResponse:
        state.metrics.count_response(request.url.path, error.status)
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        return await on_api_error(request, ApiError(error.status_code, str(error.detail)))

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, error: Exception) -> JSONResponse:
        logger.exception("unexpected error serving %s", request.url.path)
        return await on_api_error(request, ApiError(500, f"internal error: {type(error).__name__}: {error}"))

    @app.get("/health")
    async def health() -> Response:
        running = state.manager.is_running()
        return JSONResponse({"status": "ok" if running else "stopped"}, status_code=200 if running else 503)

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse({"object": "list", "data": state.adapters.cards(state.created)})

    @app.post("/v1/adapters")
    async def load_adapter(request: Request) -> Response:
        body: LoadAdapterRequest = parse_body(await request.body(), LoadAdapterRequest)
        try:
            await asyncio.to_thread(
                state.adapters.load, state.manager.model, body.name, body.path, state.manager
            )
        except ValueError as error:
            raise ApiError(400, str(error), param="name") from error
        return JSONResponse({"object": "list", "data": state.adapters.cards(state.created)})

    @app.get("/metrics")
    async def metrics() -> Response:
        text = state.metrics.render(state.manager.stats())
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body: CompletionRequest = parse_body(await request.body(), CompletionRequest)
        adapter = state.adapters.adapter_of(body.model)
        given = body.prompts()
        prompts = [_encode_prompt(state, p) for p in given]
        echoes = None
        if body.echo:
            echoes = [
                (p if isinstance(p, str) else state.tokenizer.decode(ids), ids)
                for p, ids in zip(given, prompts, strict=True)
            ]
        want_logprobs = body.logprobs is not None
        options = _options(state, body, body.max_tokens, want_logprobs, body.logprobs or 0, body.echo)
        options = dataclasses.replace(options, adapter=adapter)
        async with state.adapters.held(adapter, state.manager):  # resident until submitted
            return await _generate(state, request, body, "completion", prompts, options, echoes)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body: ChatCompletionRequest = parse_body(await request.body(), ChatCompletionRequest)
        adapter = state.adapters.adapter_of(body.model)
        prompt, options, turn = _chat_turn(state, body)
        options = dataclasses.replace(options, adapter=adapter)
        async with state.adapters.held(adapter, state.manager):
            return await _generate(state, request, body, "chat", [prompt], options, turn=turn)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        body: ResponsesRequest = parse_body(await request.body(), ResponsesRequest)
        adapter = state.adapters.adapter_of(body.model)
        conversation = state.stored.conversation(body.previous_response_id) + input_messages(body.input)
        if len(conversation) > MAX_INPUT_ITEMS:
            raise ApiError(400, f"input: the conversation exceeds {MAX_INPUT_ITEMS} messages", param="input")
        try:
            chat = body.chat_request(conversation)
            prompt, options, turn = _chat_turn(state, chat)
            options = dataclasses.replace(options, adapter=adapter)
        except ApiError as error:
            error.param = rename_param(error.param)
            raise
        if len(prompt) >= state.max_positions:
            raise ApiError(
                400,
                f"input: {len(prompt)} prompt tokens leave no room in the model's {state.max_positions} positions",
                param="input",
            )
        shape = ResponseObject(new_response_id(), body.model, body, chat, len(prompt))
        async with state.adapters.held(adapter, state.manager):
            return await _respond(state, request, shape, prompt, options, turn, conversation)

    return app


def _chat_turn(state: ServeState, body: ChatCompletionRequest) -> tuple[list[int], ChoiceOptions, TurnFormat]:
    """A chat request's prompt, what its choices are submitted with, and how its answer is read."""
    tools = tool_mode(body.tools, body.tool_choice, body.parallel_tool_calls)
    media: dict[str, object] = {}
    if has_media(body):  # the processor renders the template and prepares the images (chat/chat_media.py)
        kwargs = template_kwargs(state.reasoning, body.reasoning_effort, body.chat_template_kwargs)
        prompt, media = media_prompt(
            state.processor, body, {**kwargs, **({"tools": list(tools.tools)} if tools.tools else {})}
        )
        prompt_text = state.tokenizer.decode(prompt)
    else:
        prompt_text = chat_text(state.tokenizer, state.model_name, state.reasoning, body, tools)
        prompt = rendered_ids(state.tokenizer, prompt_text)
    # An answer under a response format (JSON, a schema) is that JSON itself: never split off as reasoning, or a
    # schema-valid answer would come back as a reasoning item with no content. (guided_* constraints may
    # write the reasoning region themselves, so they keep the split.)
    formatted = guided_of(body)[1] == "response_format"
    turn = TurnFormat(
        tools,
        reasoning=thinks(state.reasoning, state.tokenizer) and not formatted,
        prompt_text=prompt_text,
        response_template=getattr(state.tokenizer, "response_template", None),
    )
    limit = body.token_limit()
    if limit is None:
        limit = max(1, min(state.default_max_tokens, state.max_positions - len(prompt)))
    top = body.top_logprobs or 0
    options = _options(state, body, limit, body.logprobs, top, echo=False)
    if media:
        options = dataclasses.replace(options, sampling={**options.sampling, **media})
    return prompt, options, turn


def _encode_prompt(state: ServeState, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        return text_ids(state.tokenizer, prompt)
    return list(prompt)  # token ids: the manager checks them against the vocabulary


def _options(
    state: ServeState,
    body: CompletionRequest | ChatCompletionRequest,
    max_tokens: int | None,
    want_logprobs: bool,
    top_logprobs: int,
    echo: bool,
) -> ChoiceOptions:
    """What every choice of `body` is submitted with."""
    if want_logprobs and not state.logprobs:
        raise ApiError(400, "logprobs: the server was started with --no-logprobs", param="logprobs")
    chosen = body.engine_kwargs()
    asked = sorted(name for name in ASSISTANT_FIELDS if name in chosen)
    if asked and not state.has_assistant:
        raise ApiError(
            400,
            f"{asked[0]}: speculative decoding with a draft model needs a server started with --assistant-model",
            param=asked[0] if body.speculative_config is None else "speculative_config",
        )
    if want_logprobs:
        chosen["return_logprobs"] = True
        if top_logprobs:
            chosen["top_logprobs"] = top_logprobs
        if echo:
            chosen["prompt_logprobs"] = True
    return state.choices.options(
        chosen,
        body.temperature,
        body.seed,
        body.ignore_eos,
        body.stop_token_ids,
        max_tokens,
        tuple(body.stop_strings()),
        want_logprobs,
        top_logprobs,
        echo,
    )


async def _generate(
    state: ServeState,
    request: Request,
    body: CompletionRequest | ChatCompletionRequest,
    kind: str,
    prompts: list[list[int]],
    options: ChoiceOptions,
    echoes: list[tuple[str, list[int]]] | None = None,
    turn: TurnFormat | None = None,
) -> Response:
    include_usage, continuous_usage = body.stream_usage()
    prefix = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
    submitted = _submit(state, body, prompts, body.n, options, prefix, turn)
    try:
        shape = ResponseShape(
            kind,
            prefix,
            body.model,
            state.tokenizer,
            options.want_logprobs,
            sum(map(len, prompts)),
            top_logprobs=options.top_logprobs,
            continuous_usage=continuous_usage,
            reasoning=turn is not None and turn.reasoning,
        )
        streams = [
            state.choices.events(
                c,
                state.tokenizer,
                options,
                state.metrics,
                None if echoes is None else echoes[c.index // body.n],
            )
            for c in submitted
        ]
        events = merge_events(streams)
        if turn is not None:
            events = split_events(events, turn)
        indices = [c.index for c in submitted]
        if body.stream:
            state.metrics.count_response(request.url.path, 200)
            content = stream_body(shape, events, indices, include_usage)
            return CancellingStreamingResponse(content, state.choices, submitted)
        totals = await until_disconnect(request, collect_totals(events, indices))
        if totals is None:
            return Response(status_code=499)  # nobody is listening; the requests are cancelled below
        state.metrics.count_response(request.url.path, 200)
        return JSONResponse(shape.body(totals))
    except BaseException:
        state.choices.cancel_unfinished(submitted)
        raise
    finally:
        if not body.stream:
            state.choices.cancel_unfinished(submitted)


def _submit(
    state: ServeState,
    body: CompletionRequest | ChatCompletionRequest,
    prompts: list[list[int]],
    n: int,
    options: ChoiceOptions,
    prefix: str,
    turn: TurnFormat | None,
) -> list[Submitted]:
    """Submit every choice under the request's output constraint (or its forced tool call's)."""
    guided, guided_field = guided_of(body)
    forced = None if turn is None else turn.tools.guided()
    if forced is not None:
        if guided is not None:
            raise ApiError(
                400,
                f"tool_choice: a required or named tool call is its own output constraint; drop {guided_field}",
                param="tool_choice",
            )
        guided, guided_field = forced, "tools"
    if guided is not None:
        options = dataclasses.replace(options, sampling={**options.sampling, "guided": guided})
    try:
        return state.choices.submit(prompts, n, options, prefix)
    except ApiError as error:
        if error.param == "guided":  # name the field the client sent
            error.param = guided_field
        raise


async def _respond(
    state: ServeState,
    request: Request,
    shape: ResponseObject,
    prompt: list[int],
    options: ChoiceOptions,
    turn: TurnFormat,
    conversation: list[dict[str, object]],
) -> Response:
    """A Responses API answer: one choice's events as output items, whole or as the stream's events; a
    finished one's conversation is stored for `previous_response_id` (unless `store` is false)."""
    try:
        submitted = _submit(state, shape.chat, [prompt], 1, options, shape.response_id, turn)
    except ApiError as error:
        error.param = rename_param(error.param)
        raise
    try:
        events = split_events(
            state.choices.events(submitted[0], state.tokenizer, options, state.metrics), turn
        )
        if shape.body.stream:
            state.metrics.count_response(request.url.path, 200)
            content = response_stream(
                shape, events, lambda output: _store(state, shape, conversation, output)
            )
            return CancellingStreamingResponse(content, state.choices, submitted)
        output = await until_disconnect(request, collect_output(events))
        if output is None:
            return Response(status_code=499)
        _store(state, shape, conversation, output)
        state.metrics.count_response(request.url.path, 200)
        return JSONResponse(shape.render(output, output.status))
    except BaseException:
        state.choices.cancel_unfinished(submitted)
        raise
    finally:
        if not shape.body.stream:
            state.choices.cancel_unfinished(submitted)


def _store(
    state: ServeState, shape: ResponseObject, conversation: list[dict[str, object]], output: OutputItems
) -> None:
    if shape.body.store:
        state.stored.keep(shape.response_id, [*conversation, output.message()])
