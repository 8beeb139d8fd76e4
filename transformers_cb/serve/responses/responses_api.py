"""OpenAI's Responses API (`POST /v1/responses`) as a chat turn: the request becomes a chat request, the answer
becomes output items.

A request's `instructions` (a system message) and `input` items (serve/responses/response_input.py: messages, with
`input_image` data URLs as chat's `image_url` parts; `function_call`, `function_call_output`,
`reasoning`) are translated into chat messages, and its `tools`
(`{"type": "function", "name", "parameters"}`), `tool_choice`, `reasoning` (its `effort`), `text` (its
`format`) and sampling fields into the chat request's: the prompt, tool calling and reasoning are the chat path's (serve/app.py,
serve/chat/tools.py, serve/chat/turn.py). The choice's events become output items (`reasoning`, `message`,
`function_call`) through one `OutputItems` (serve/responses/response_output.py), which also gives the stream's events,
so a streamed response and a whole one hold the same items. Finished responses' conversations (without their `instructions`, as OpenAI
keeps them) stay in a bounded in-memory LRU, `ResponseStore`, for `previous_response_id`.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import Field, ValidationError

from ..protocol import ApiError, ChatCompletionRequest, _Body, _Part
from .response_input import field_path
from .response_output import OutputItems

MAX_STORED_RESPONSES = 256  # finished conversations kept for `previous_response_id`; the oldest goes first
RESPONSE_ID = re.compile(r"^resp_[0-9a-f]{32}$")  # the ids this server gives
# A chat field an error names -> the Responses field it came from.
RENAMED_PARAMS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "reasoning_effort": "reasoning.effort",
    "response_format": "text.format",
}


class TextFormat(_Part):
    """The `format` of a request's `text`: `text`, `json_object`, or `json_schema` with the schema inline
    (`name`, `schema`)."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str = "output"
    schema_: dict[str, object] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextOptions(_Part):
    format: TextFormat | None = None


class ReasoningOptions(_Part):
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: str | None = None  # accepted: the reasoning is returned whole, as `reasoning_text`


class ResponsesRequest(_Body):
    model: str
    input: str | list[object]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    max_output_tokens: int | None = Field(default=None, ge=1)
    seed: int | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, object] | None = None
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningOptions | None = None
    text: TextOptions | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None

    def chat_request(self, conversation: list[dict[str, object]]) -> ChatCompletionRequest:
        """The chat request this is: `instructions` first, then `conversation`."""
        messages = list(conversation)
        if self.instructions is not None:
            messages.insert(0, {"role": "system", "content": self.instructions})
        if not messages:
            raise ApiError(400, "input: give at least one input item", param="input")
        chat: dict[str, object] = {"model": self.model, "messages": messages}
        for name in ("temperature", "top_p", "seed", "parallel_tool_calls", "user"):
            if getattr(self, name) is not None:
                chat[name] = getattr(self, name)
        if self.max_output_tokens is not None:
            chat["max_tokens"] = self.max_output_tokens
        if self.tools is not None:
            chat["tools"] = [_chat_tool(i, tool) for i, tool in enumerate(self.tools)]
        if self.tool_choice is not None:
            chat["tool_choice"] = _chat_tool_choice(self.tool_choice)
        if self.reasoning is not None and self.reasoning.effort is not None:
            chat["reasoning_effort"] = self.reasoning.effort
        text_format = self.text.format if self.text is not None else None
        if text_format is not None and text_format.type != "text":
            chat["response_format"] = _response_format(text_format)
        try:
            return ChatCompletionRequest.model_validate(chat)
        except ValidationError as error:
            first = error.errors()[0]
            where = rename_param(".".join(field_path(first["loc"])))
            raise ApiError(400, f"{where}: {first['msg']}", param=where) from None


def rename_param(param: str | None) -> str | None:
    """The Responses field behind a chat field an error names (`tools.0.function.name` -> `tools.0.name`)."""
    if param is None:
        return None
    head, _, rest = param.partition(".")
    if head == "tools":
        return param.replace(".function.", ".", 1).replace(".function", "", 1)
    if head in RENAMED_PARAMS:
        return RENAMED_PARAMS[head] + ("." + rest if rest and head != "messages" else "")
    return param


def _chat_tool(index: int, tool: object) -> dict[str, object]:
    where = f"tools.{index}"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        raise ApiError(
            400, f"{where}.type: only function tools are supported, got {kind!r}", param=f"{where}.type"
        )
    if not isinstance(tool.get("name"), str):
        raise ApiError(400, f"{where}.name: a function tool needs a name", param=f"{where}.name")
    function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict[str, object]) -> str | dict[str, object]:
    if isinstance(choice, str):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise ApiError(
            400, 'tool_choice: a named choice is {"type": "function", "name": ...}', param="tool_choice"
        )
    return {"type": "function", "function": {"name": choice["name"]}}


def _response_format(text_format: TextFormat) -> dict[str, object]:
    if text_format.type == "json_object":
        return {"type": "json_object"}
    if text_format.schema_ is None:
        raise ApiError(400, "text.format: type json_schema needs a schema", param="text.format.schema")
    return {"type": "json_schema", "json_schema": {"name": text_format.name, "schema": text_format.schema_}}


# -- previous_response_id ---------------------------------------------------------------


@dataclass
class ResponseStore:
    """Finished responses' conversations (chat messages, without `instructions`), the `bound` most recent."""

    bound: int = MAX_STORED_RESPONSES
    conversations: OrderedDict[str, list[dict[str, object]]] = field(default_factory=OrderedDict)

    def conversation(self, response_id: str | None) -> list[dict[str, object]]:
        if response_id is None:
            return []
        if not RESPONSE_ID.match(response_id):
            raise ApiError(
                400,
                f"previous_response_id: {response_id[:80]!r} is not a response id (resp_ and 32 hex digits)",
                param="previous_response_id",
            )
        found = self.conversations.get(response_id)
        if found is None:
            raise ApiError(
                404,
                f"previous_response_id: no response {response_id!r} (unknown, not stored, or one of more than "
                f"{self.bound} since)",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        self.conversations.move_to_end(response_id)
        return list(found)

    def keep(self, response_id: str, conversation: list[dict[str, object]]) -> None:
        self.conversations[response_id] = conversation
        self.conversations.move_to_end(response_id)
        while len(self.conversations) > self.bound:
            self.conversations.popitem(last=False)


# -- the response object and its stream's framing -------------------------------------------------


def new_response_id() -> str:
    return "resp_" + uuid.uuid4().hex


@dataclass
class ResponseObject:
    """The `response` object's fields besides its output: what the request asked for."""

    response_id: str
    model: str
    body: ResponsesRequest
    chat: ChatCompletionRequest
    num_prompt_tokens: int
    created_at: int = field(default_factory=lambda: int(time.time()))

    def render(
        self, output: OutputItems | None, status: str, error: ApiError | None = None
    ) -> dict[str, object]:
        body = self.body
        response: dict[str, object] = {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "model": self.model,
            "status": status,
            # OpenAI's codes are a closed list; the engine's own code stays in the stream's `error` event.
            "error": None if error is None else {"code": "server_error", "message": error.message},
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {},
            "output": [] if output is None else output.items,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": body.reasoning.effort if body.reasoning else None, "summary": None},
            "store": body.store,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": {"format": {"type": "text"}}
            if body.text is None or body.text.format is None
            else {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)},
            "tool_choice": _wire_tool_choice(body.tool_choice, bool(body.tools)),
            "tools": [_wire_tool(tool) for tool in body.tools or []],
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "truncation": "disabled",
            "user": body.user,
            "usage": None,
        }
        if output is not None and status in ("completed", "incomplete"):
            generated = output.num_generated
            response["usage"] = {
                "input_tokens": self.num_prompt_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": generated,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.num_prompt_tokens + generated,
            }
        return response


def _wire_tool(tool: dict[str, object]) -> dict[str, object]:
    return {
        "type": "function",
        "name": tool["name"],
        "description": tool.get("description"),
        "parameters": tool.get("parameters"),
        "strict": tool.get("strict", False),
    }


def _wire_tool_choice(choice: str | dict[str, object] | None, has_tools: bool) -> str | dict[str, object]:
    if choice is None:
        return "auto" if has_tools else "none"
    return choice


def sse_event(event: dict[str, object], sequence_number: int) -> bytes:
    """One Responses stream event: `event:` names its type, `data:` carries it with its sequence number."""
    payload = json.dumps(
        {**event, "sequence_number": sequence_number}, ensure_ascii=False, separators=(",", ":")
    )
    return f"event: {event['type']}\ndata: {payload}\n\n".encode()
