"""The OpenAI request bodies we accept, and the OpenAI-style error we answer with.

Known fields are validated strictly: a wrong type or an out-of-range value is a 400 naming it.
A field this server does not know is accepted and ignored with a warning in the log (as vLLM
and transformers serve do: clients send their own extensions); a known field it cannot honour
(`suffix`, `best_of`) away from its neutral value is a 400 naming it, so a request never gets a
silently different meaning.

Per-request sampling fields reach the engine through one table, `ENGINE_FIELDS` (body field ->
`add_request` keyword; a field at the keyword's neutral value, from sampling/neutral.py, is left out): a
new field is one declaration plus one row there. The output constraints (`response_format`, `guided_*`)
become one `guided=` value in serve/response_format.py.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Literal, TypeGuard, cast

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..sampling.neutral import is_neutral

logger = logging.getLogger(__name__)

MAX_N = 16  # choices per request: each is one manager request
MAX_TOP_LOGPROBS = 20  # top alternatives per token (OpenAI's chat cap; completions' `logprobs` too)

# Body field -> the `add_request` keyword it becomes; left out at the keyword's neutral value.
# `temperature`, `seed`, `stop*`, `ignore_eos`, `logprobs` / `echo` are shaped in choices.py.
ENGINE_FIELDS: tuple[tuple[str, str], ...] = (
    ("top_p", "top_p"),
    ("top_k", "top_k"),  # -1 (vLLM's "off") is normalized to 0
    ("min_p", "min_p"),
    ("repetition_penalty", "repetition_penalty"),
    ("presence_penalty", "presence_penalty"),
    ("frequency_penalty", "frequency_penalty"),
    ("logit_bias", "logit_bias"),
    ("min_tokens", "min_tokens"),
)
# vLLM's `speculative_config` methods that map onto prompt lookup.
NGRAM_METHODS = ("ngram", "[ngram]")
# ... and those that map onto the server's draft model (`--assistant-model`).
DRAFT_MODEL_METHODS = ("draft_model",)
# The per-request settings of the draft model (generate()'s names).
ASSISTANT_FIELDS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")


@dataclass
class ApiError(Exception):
    """An error answered as `{"error": {...}}` with `status`."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None

    @property
    def type(self) -> str:
        if self.status == 429:
            return "rate_limit_error"
        if self.status >= 500:
            return "server_error"
        return "invalid_request_error"

    def body(self) -> dict[str, object]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Body(BaseModel):
    # Unknown fields are kept in `model_extra` (and logged by `parse_body`), never used.
    model_config = ConfigDict(extra="allow", strict=True)

    def check_neutral(self) -> None:
        """Raise a 400 for a known field this server cannot honour (away from its neutral value)."""


class _Part(BaseModel):
    # Inside a body (messages, stream_options), unknown keys are dropped like unknown fields.
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Part):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: `usage` so far in every chunk


class JsonSchemaFormat(_Part):
    """OpenAI's `response_format.json_schema`: the schema is under `schema`."""

    name: str
    schema_: dict[str, object] = Field(default_factory=dict, alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(_Part):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SpeculativeConfig(_Part):
    """vLLM's `speculative_config`, per request: `{"method": "ngram", "num_speculative_tokens": k,
    "prompt_lookup_max": n}` is prompt lookup with `prompt_lookup_num_tokens=k`, `max_matching_ngram_size=n`
    (`prompt_lookup_min` is accepted and ignored: lookup tries n-gram sizes down to 2, or 1 when
    `prompt_lookup_max` is 1; scheduler/speculation/prompt_lookup.py's `MIN_MATCH_NGRAM`)."""

    method: str = "ngram"
    num_speculative_tokens: int = Field(ge=0)
    model: str | None = None  # the draft model's name (method "draft_model"); the server has one at most
    prompt_lookup_max: int | None = Field(default=None, ge=1)
    prompt_lookup_min: int | None = Field(default=None, ge=1)


class _SamplingFields(_Body):
    """Fields shared by completions and chat completions."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # vLLM's extension: -1 or 0 turn it off
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = Field(default=None, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Structured outputs (serve/response_format.py): OpenAI's response_format, vLLM's guided_* extensions.
    response_format: ResponseFormat | None = None
    guided_json: dict[str, object] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Speculative decoding: generate()'s names, or vLLM's `speculative_config` (method "ngram").
    prompt_lookup_num_tokens: int | None = Field(default=None, ge=0)
    max_matching_ngram_size: int | None = Field(default=None, ge=1)
    # The server's draft model (`--assistant-model`): generate()'s names, or speculative_config's
    # method "draft_model".
    num_assistant_tokens: int | None = Field(default=None, ge=0)
    num_assistant_tokens_schedule: Literal["constant", "heuristic", "heuristic_transient"] | None = None
    assistant_confidence_threshold: float | None = Field(default=None, ge=0.0, lt=1.0)
    speculative_config: SpeculativeConfig | None = None

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(s == "" for s in stops):
            raise ApiError(400, "stop: empty stop strings are not allowed", param="stop")
        return stops

    def stream_usage(self) -> tuple[bool, bool]:
        """(`include_usage`, `continuous_usage_stats`) of a streaming request."""
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed with stream=true", param="stream_options")
        options = self.stream_options or StreamOptions()
        return options.include_usage, options.continuous_usage_stats

    def engine_kwargs(self) -> dict[str, object]:
        """The `ENGINE_FIELDS` given away from their neutral value, as `add_request` keywords."""
        chosen = {}
        for name, keyword in ENGINE_FIELDS:
            value = getattr(self, name)
            if name == "top_k" and value == -1:
                value = 0
            if value is not None and value != {} and not is_neutral(keyword, value):
                chosen[keyword] = value
        chosen.update(self._speculative_kwargs())
        return chosen

    def _speculative_kwargs(self) -> dict[str, object]:
        """Speculative decoding (docs/speculative_decoding.md) by prompt lookup or the server's draft model,
        from generate()'s names or vLLM's `speculative_config` (a 400 for another method), as keywords."""
        given: dict[str, object] = {name: getattr(self, name) for name in ASSISTANT_FIELDS}
        config = self.speculative_config
        if config is None:
            given["prompt_lookup_num_tokens"] = self.prompt_lookup_num_tokens
            given["max_matching_ngram_size"] = self.max_matching_ngram_size
            return {name: value for name, value in given.items() if value is not None}
        if config.method not in NGRAM_METHODS + DRAFT_MODEL_METHODS:
            raise ApiError(
                400,
                f"speculative_config.method={config.method!r} is not supported; only 'ngram' (prompt lookup) "
                "and 'draft_model' (the server's --assistant-model)",
                param="speculative_config",
            )
        if self.prompt_lookup_num_tokens is not None or self.num_assistant_tokens is not None:
            raise ApiError(
                400,
                "give prompt_lookup_num_tokens / num_assistant_tokens or speculative_config, not both",
                param="speculative_config",
            )
        kwargs = {name: value for name, value in given.items() if value is not None}
        if config.method in DRAFT_MODEL_METHODS:
            kwargs["num_assistant_tokens"] = config.num_speculative_tokens
            return kwargs
        kwargs["prompt_lookup_num_tokens"] = config.num_speculative_tokens
        if config.prompt_lookup_max is not None:
            kwargs["max_matching_ngram_size"] = config.prompt_lookup_max
        return kwargs

    def check_neutral(self) -> None:
        logit_bias = self.logit_bias or {}
        for key in logit_bias:
            if not key.isdigit():
                raise ApiError(400, f"logit_bias: keys must be token ids, got {key!r}", param="logit_bias")
            if not -100 <= logit_bias[key] <= 100:
                raise ApiError(400, "logit_bias: biases must be in [-100, 100]", param="logit_bias")


def _is_token_ids(prompt: list[str] | list[int] | list[list[int]]) -> TypeGuard[list[int]]:
    return all(isinstance(p, int) for p in prompt)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0)  # OpenAI's default; 0 with echo scores the prompt only
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)

    def check_neutral(self) -> None:
        super().check_neutral()
        _refuse_unless(self.suffix is None, "suffix")
        _refuse_unless(self.best_of in (None, self.n), "best_of")

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of prompts (OpenAI accepts one or a batch, text or token ids)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise ApiError(400, "prompt: must not be empty", param="prompt")
        if _is_token_ids(prompt):
            return [list(prompt)]
        # Not one list of token ids: a batch of texts or of token-id lists (pydantic validated the prompt).
        return list(cast("list[str] | list[list[int]]", prompt))


class TextPart(_Part):
    type: Literal["text"]
    text: str


class ImageUrl(_Part):
    url: str  # only `data:image/...;base64,...` URLs are read (serve/chat/chat_media.py)
    detail: str | None = None  # accepted, not used: the model's processor decides the resolution


class ImagePart(_Part):
    type: Literal["image_url"]
    image_url: ImageUrl


class InputAudio(_Part):
    data: str  # base64
    format: str  # "wav" is decoded (serve/chat/chat_media.py)


class AudioPart(_Part):
    type: Literal["input_audio"]
    input_audio: InputAudio


ContentPart = TextPart | ImagePart | AudioPart


class FunctionCall(_Part):
    name: str
    arguments: str  # JSON text, as OpenAI sends it back


class AssistantToolCall(_Part):
    """A tool call of an earlier assistant turn (what the server answered before)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Part):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None  # assistant turns
    tool_call_id: str | None = None  # tool turns: the call this answers
    reasoning_content: str | None = None  # an assistant turn's reasoning, as the server answered it

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content if isinstance(part, TextPart))
        return self.content or ""

    @property
    def has_media(self) -> bool:
        return isinstance(self.content, list) and any(not isinstance(p, TextPart) for p in self.content)


class ToolFunction(_Part):
    name: str
    description: str | None = None
    parameters: dict[str, object] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # accepted: `tool_choice` required / named are always schema-exact


class ToolDefinition(_Part):
    type: Literal["function"]
    function: ToolFunction


# Keywords of `apply_chat_template` a request's `chat_template_kwargs` may not set (the server sets them).
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
        "tokenize",
        "return_dict",
        "return_tensors",
        "continue_final_message",
        "chat_template",
        "padding",
        "truncation",
        "max_length",
    }
)
MAX_TEMPLATE_KWARGS_CHARS = 20_000


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolDefinition] | None = None  # checked and resolved in serve/chat/tools.py
    tool_choice: str | dict[str, object] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, object] | None = None  # e.g. {"enable_thinking": false}
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None

    def check_neutral(self) -> None:
        super().check_neutral()
        if self.top_logprobs and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        kwargs = self.chat_template_kwargs or {}
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))
        if reserved:
            raise ApiError(
                400,
                f"chat_template_kwargs: {', '.join(reserved)} is set by the server, not by a request",
                param="chat_template_kwargs",
            )
        try:
            size = len(json.dumps(kwargs))
        except (
            TypeError,
            ValueError,
        ):  # not reachable from JSON, but a dict built in Python may hold anything
            size = MAX_TEMPLATE_KWARGS_CHARS + 1
        if size > MAX_TEMPLATE_KWARGS_CHARS:
            raise ApiError(
                400,
                f"chat_template_kwargs: more than {MAX_TEMPLATE_KWARGS_CHARS} characters of JSON",
                param="chat_template_kwargs",
            )

    def token_limit(self) -> int | None:
        both = self.max_tokens is not None and self.max_completion_tokens is not None
        if both and self.max_tokens != self.max_completion_tokens:
            raise ApiError(400, "max_tokens and max_completion_tokens disagree; send one", param="max_tokens")
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def _refuse_unless(neutral: bool, name: str) -> None:
    if not neutral:
        raise ApiError(400, f"{name} is not supported by this server (only its default value)", param=name)


class LoadAdapterRequest(_Body):
    """`POST /v1/adapters`: load the PEFT adapter folder `path` as `name` (serve/served_adapters.py)."""

    name: str
    path: str


def parse_body(raw: bytes, model_type: type[_Body]) -> Any:
    """Decode and validate a JSON body into `model_type`, or raise a 400 `ApiError` naming the problem."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ApiError(400, f"the request body is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        request = model_type.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise ApiError(400, f"{where}: {first['msg']}", param=where or None) from None
    if request.model_extra:
        logger.warning("ignoring unknown request field(s): %s", ", ".join(sorted(request.model_extra)))
    request.check_neutral()
    return request
