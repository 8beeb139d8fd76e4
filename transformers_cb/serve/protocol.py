"""The OpenAI request bodies we accept, and the OpenAI-style error we answer with.

Bodies are validated strictly: a wrong type, an out-of-range value or an
unknown field is a 400 naming it. OpenAI fields this server does not implement
are accepted only at their neutral value (e.g. `frequency_penalty=0`), so a
request never gets a silently different meaning.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_N = 16  # choices per request: each is one manager request


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

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    """OpenAI's `response_format.json_schema`: the schema is under `schema`."""

    name: str
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingFields(_Strict):
    """Fields shared by completions and chat completions."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # an extension (vLLM's): -1 or 0 turn it off
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Known OpenAI fields without an implementation: accepted at their neutral value only.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # Structured outputs (serve/guided.py): OpenAI's response_format, vLLM's guided_* extensions.
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(s == "" for s in stops):
            raise ApiError(400, "stop: empty stop strings are not allowed", param="stop")
        return stops

    def include_usage_in_stream(self) -> bool:
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed with stream=true", param="stream_options")
        return self.stream_options is not None and self.stream_options.include_usage

    def check_neutral(self) -> None:
        _refuse_unless(self.presence_penalty in (None, 0.0), "presence_penalty")
        _refuse_unless(self.frequency_penalty in (None, 0.0), "frequency_penalty")
        _refuse_unless(not self.logit_bias, "logit_bias")


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)

    def check_neutral(self) -> None:
        super().check_neutral()
        _refuse_unless(not self.echo, "echo")
        _refuse_unless(self.suffix is None, "suffix")
        _refuse_unless(self.best_of in (None, self.n), "best_of")

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of prompts (OpenAI accepts one or a batch, text or token ids)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise ApiError(400, "prompt: must not be empty", param="prompt")
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        return list(prompt)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def check_neutral(self) -> None:
        super().check_neutral()
        _refuse_unless(not self.tools, "tools")
        _refuse_unless(self.tool_choice in (None, "none"), "tool_choice")
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true", param="top_logprobs")

    def token_limit(self) -> int | None:
        both = self.max_tokens is not None and self.max_completion_tokens is not None
        if both and self.max_tokens != self.max_completion_tokens:
            raise ApiError(400, "max_tokens and max_completion_tokens disagree; send one", param="max_tokens")
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def _refuse_unless(neutral: bool, name: str) -> None:
    if not neutral:
        raise ApiError(400, f"{name} is not supported by this server (only its default value)", param=name)


def parse_body(raw: bytes, model_type: type[_Strict]) -> Any:
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
    request.check_neutral()
    return request
