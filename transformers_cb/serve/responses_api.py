"""OpenAI's Responses API (`POST /v1/responses`) as a chat turn: the request becomes a chat request, the answer
becomes output items.

A request's `instructions` (a system message) and `input` items (messages, with `input_image` data URLs as
chat's `image_url` parts (serve/media.py); `function_call`,
`function_call_output`, `reasoning`) are translated into chat messages, and its `tools`
(`{"type": "function", "name", "parameters"}`), `tool_choice`, `reasoning` (its `effort`), `text` (its
`format`) and sampling fields into the chat request's: the prompt, tool calling and reasoning are the chat path's (serve/app.py,
serve/tools.py, serve/assistant.py). The choice's events become output items (`reasoning`, `message`,
`function_call`) through one `OutputItems`, which also gives the stream's events, so a streamed response and
a whole one hold the same items. Finished responses' conversations (without their `instructions`, as OpenAI
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

from pydantic import BaseModel, Field, ValidationError

from .choices import ChoiceEvent
from .media import decode_data_url, load_image
from .protocol import ApiError, ChatCompletionRequest, _Body, _Part
from .tools import ToolCall

MAX_STORED_RESPONSES = 256  # finished conversations kept for `previous_response_id`; the oldest goes first
MAX_INPUT_ITEMS = 4096  # input items per request (and in a conversation continued by `previous_response_id`)
RESPONSE_ID = re.compile(r"^resp_[0-9a-f]{32}$")  # the ids this server gives
UNION_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict"})  # pydantic's names of union branches
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
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextOptions(_Part):
    format: TextFormat | None = None


class ReasoningOptions(_Part):
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: str | None = None  # accepted: the reasoning is returned whole, as `reasoning_text`


class ResponsesRequest(_Body):
    model: str
    input: str | list[Any]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    max_output_tokens: int | None = Field(default=None, ge=1)
    seed: int | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningOptions | None = None
    text: TextOptions | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None

    def chat_request(self, conversation: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat request this is: `instructions` first, then `conversation`."""
        messages = list(conversation)
        if self.instructions is not None:
            messages.insert(0, {"role": "system", "content": self.instructions})
        if not messages:
            raise ApiError(400, "input: give at least one input item", param="input")
        chat: dict[str, Any] = {"model": self.model, "messages": messages}
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
            where = rename_param(".".join(_field_path(first["loc"])))
            raise ApiError(400, f"{where}: {first['msg']}", param=where) from None


def _field_path(loc: tuple[Any, ...]) -> list[str]:
    """A validation error's location without pydantic's union tags (`content.str` -> `content`)."""
    return [str(part) for part in loc if not (isinstance(part, str) and (part in UNION_TAGS or "[" in part))]


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


def _chat_tool(index: int, tool: Any) -> dict[str, Any]:
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


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise ApiError(
            400, 'tool_choice: a named choice is {"type": "function", "name": ...}', param="tool_choice"
        )
    return {"type": "function", "function": {"name": choice["name"]}}


def _response_format(text_format: TextFormat) -> dict[str, Any]:
    if text_format.type == "json_object":
        return {"type": "json_object"}
    if text_format.schema_ is None:
        raise ApiError(400, "text.format: type json_schema needs a schema", param="text.format.schema")
    return {"type": "json_schema", "json_schema": {"name": text_format.name, "schema": text_format.schema_}}


# -- input items -> chat messages ------------------------------------------------------


class ContentPart(_Part):
    type: Literal["input_text", "output_text", "text"]
    text: str


class ImageInputPart(_Part):
    """An `input_image` part: its `image_url` a data URL (serve/media.py reads no other); `file_id` (the
    Files API) is refused by name."""

    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None  # accepted, not used: the model's processor decides the resolution


class MessageItem(_Part):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart | ImageInputPart]


class FunctionCallItem(_Part):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str
    arguments: str


class FunctionCallOutputItem(_Part):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[ContentPart]


class ReasoningText(_Part):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(_Part):
    type: Literal["reasoning"]
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None


ITEM_MODELS: dict[str, type[BaseModel]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}


def _text(content: str | list[ContentPart] | list[ContentPart | ImageInputPart]) -> str:
    return content if isinstance(content, str) else "".join(getattr(part, "text", "") for part in content)


def _message_content(index: int, item: MessageItem) -> str | list[dict[str, Any]]:
    """A message's chat content: its text, or with images chat's content parts (`text`, `image_url`), each
    image checked here so that a bad one is a 400 naming its input field (`input.0.content.1.image_url`)."""
    if isinstance(item.content, str) or not any(isinstance(p, ImageInputPart) for p in item.content):
        return _text(item.content)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(item.content):
        where = f"input.{index}.content.{j}"
        if not isinstance(part, ImageInputPart):
            parts.append({"type": "text", "text": part.text})
            continue
        if part.image_url is None:
            raise ApiError(
                400,
                f"{where}.image_url: give the image as a data URL (file_id is not read)",
                param=f"{where}.image_url",
            )
        _, data = decode_data_url(part.image_url, f"{where}.image_url")
        load_image(data, f"{where}.image_url")
        parts.append({"type": "image_url", "image_url": {"url": part.image_url}})
    return parts


def input_messages(given: str | list[Any]) -> list[dict[str, Any]]:
    """The chat messages of a request's `input` (a 400 naming `input.i...` for an item it cannot read)."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    if len(given) > MAX_INPUT_ITEMS:
        raise ApiError(400, f"input: at most {MAX_INPUT_ITEMS} items, got {len(given)}", param="input")
    messages: list[dict[str, Any]] = []
    reasoning: str | None = None  # a reasoning item waits for the assistant turn it belongs to
    for i, raw in enumerate(given):
        item = _item(i, raw)
        if isinstance(item, ReasoningItem):
            reasoning = "".join(part.text for part in item.content or item.summary)
        elif isinstance(item, MessageItem):
            message: dict[str, Any] = {"role": item.role, "content": _message_content(i, item)}
            if item.role == "assistant" and reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
            messages.append(message)
        elif isinstance(item, FunctionCallItem):
            try:
                json.loads(item.arguments)
            except (ValueError, RecursionError):
                where = f"input.{i}.arguments"
                raise ApiError(400, f"{where}: not JSON text", param=where) from None
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": None, "tool_calls": []}
                messages.append(last)
            if reasoning is not None:
                last["reasoning_content"], reasoning = reasoning, None
            last.setdefault("tool_calls", []).append(call)
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
    return messages


def _item(index: int, raw: Any) -> BaseModel:
    where = f"input.{index}"
    if not isinstance(raw, dict):
        raise ApiError(400, f"{where}: an input item is a JSON object", param=where)
    kind = raw.get("type", "message")
    model = ITEM_MODELS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise ApiError(
            400,
            f"{where}.type: {kind!r} is not one of {', '.join(ITEM_MODELS)}",
            param=f"{where}.type",
        )
    try:
        return model.model_validate(raw)
    except ValidationError as error:
        first = error.errors()[0]
        place = ".".join([where, *_field_path(first["loc"])])
        raise ApiError(400, f"{place}: {first['msg']}", param=place) from None


# -- previous_response_id ---------------------------------------------------------------


@dataclass
class ResponseStore:
    """Finished responses' conversations (chat messages, without `instructions`), the `bound` most recent."""

    bound: int = MAX_STORED_RESPONSES
    conversations: OrderedDict[str, list[dict[str, Any]]] = field(default_factory=OrderedDict)

    def conversation(self, response_id: str | None) -> list[dict[str, Any]]:
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

    def keep(self, response_id: str, conversation: list[dict[str, Any]]) -> None:
        self.conversations[response_id] = conversation
        self.conversations.move_to_end(response_id)
        while len(self.conversations) > self.bound:
            self.conversations.popitem(last=False)


# -- choice events -> output items and stream events ------------------------------------------


def new_response_id() -> str:
    return "resp_" + uuid.uuid4().hex


@dataclass
class OutputItems:
    """One choice's output as Responses items, built from its events; `add` and `finish` return the stream
    events each step makes (without `sequence_number`, which the stream numbers)."""

    items: list[dict[str, Any]] = field(default_factory=list)
    open_kind: str | None = None  # "reasoning" or "message": the item text is being added to
    reasoning_text: str = ""
    message_text: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str | None = None
    num_generated: int = 0

    @property
    def status(self) -> str:
        return "incomplete" if self.finish_reason == "length" else "completed"

    def add(self, event: ChoiceEvent) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        self.num_generated += event.num_generated
        if event.reasoning:
            out += self._text("reasoning", event.reasoning)
        if event.text:
            out += self._text("message", event.text)
        for call in event.tool_calls:
            out += self._close()
            out += self._call(call)
        if event.is_last:
            self.finish_reason = event.finish_reason
        return out

    def finish(self) -> list[dict[str, Any]]:
        out = self._close()
        if not self.items:  # nothing at all: still one (empty) message, as a chat turn has content
            out += self._open("message") + self._close()
        return out

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        out = self._close() if self.open_kind not in (None, kind) else []
        if self.open_kind is None:
            out += self._open(kind)
        item = self.items[-1]
        if kind == "reasoning":
            self.reasoning_text += text
            delta: dict[str, Any] = {"type": "response.reasoning_text.delta", "delta": text}
        else:
            self.message_text += text
            delta = {"type": "response.output_text.delta", "delta": text, "logprobs": []}
        return [
            *out,
            {**delta, "item_id": item["id"], "output_index": len(self.items) - 1, "content_index": 0},
        ]

    def _open(self, kind: str) -> list[dict[str, Any]]:
        self.open_kind = kind
        if kind == "reasoning":
            self.reasoning_text = ""
            item = {"id": "rs_" + uuid.uuid4().hex, "type": "reasoning", "summary": [], "content": []}
            part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
        else:
            self.message_text = ""
            item = {"id": "msg_" + uuid.uuid4().hex, "type": "message", "role": "assistant", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        item["status"] = "in_progress"
        self.items.append(item)
        where = {"output_index": len(self.items) - 1}
        return [
            {"type": "response.output_item.added", "item": dict(item), **where},
            {
                "type": "response.content_part.added",
                "item_id": item["id"],
                "content_index": 0,
                "part": part,
                **where,
            },
        ]

    def _close(self) -> list[dict[str, Any]]:
        kind, self.open_kind = self.open_kind, None
        if kind is None:
            return []
        item, where = self.items[-1], {"output_index": len(self.items) - 1}
        if kind == "reasoning":
            part: dict[str, Any] = {"type": "reasoning_text", "text": self.reasoning_text}
            done: dict[str, Any] = {"type": "response.reasoning_text.done", "text": self.reasoning_text}
        else:
            part = {"type": "output_text", "text": self.message_text, "annotations": [], "logprobs": []}
            done = {"type": "response.output_text.done", "text": self.message_text, "logprobs": []}
        item["content"], item["status"] = [part], "completed"
        ids = {"item_id": item["id"], "content_index": 0, **where}
        return [
            {**done, **ids},
            {"type": "response.content_part.done", "part": part, **ids},
            {"type": "response.output_item.done", "item": item, **where},
        ]

    def _call(self, call: ToolCall) -> list[dict[str, Any]]:
        self.calls.append(call)
        item = {
            "id": "fc_" + uuid.uuid4().hex,
            "type": "function_call",
            "call_id": call.id,
            "name": call.name,
            "arguments": call.arguments,
            "status": "completed",
        }
        self.items.append(item)
        where = {"item_id": item["id"], "output_index": len(self.items) - 1}
        return [
            {
                "type": "response.output_item.added",
                "item": {**item, "arguments": "", "status": "in_progress"},
                "output_index": where["output_index"],
            },
            {"type": "response.function_call_arguments.delta", "delta": call.arguments, **where},
            {
                "type": "response.function_call_arguments.done",
                "arguments": call.arguments,
                "name": call.name,
                **where,
            },
            {"type": "response.output_item.done", "item": item, "output_index": where["output_index"]},
        ]

    def message(self) -> dict[str, Any]:
        """The assistant turn these items are, as a chat message (what `previous_response_id` continues)."""
        text = "".join(
            part["text"] for item in self.items if item["type"] == "message" for part in item["content"]
        )
        reasoning = "".join(
            part["text"] for item in self.items if item["type"] == "reasoning" for part in item["content"]
        )
        message: dict[str, Any] = {"role": "assistant", "content": text or None}
        if reasoning:
            message["reasoning_content"] = reasoning
        if self.calls:
            message["tool_calls"] = [call.wire() for call in self.calls]
        elif message["content"] is None:
            message["content"] = ""
        return message


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
    ) -> dict[str, Any]:
        body = self.body
        response: dict[str, Any] = {
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


def _wire_tool(tool: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "function",
        "name": tool["name"],
        "description": tool.get("description"),
        "parameters": tool.get("parameters"),
        "strict": tool.get("strict", False),
    }


def _wire_tool_choice(choice: str | dict[str, Any] | None, has_tools: bool) -> str | dict[str, Any]:
    if choice is None:
        return "auto" if has_tools else "none"
    return choice


def sse_event(event: dict[str, Any], sequence_number: int) -> bytes:
    """One Responses stream event: `event:` names its type, `data:` carries it with its sequence number."""
    payload = json.dumps(
        {**event, "sequence_number": sequence_number}, ensure_ascii=False, separators=(",", ":")
    )
    return f"event: {event['type']}\ndata: {payload}\n\n".encode()
