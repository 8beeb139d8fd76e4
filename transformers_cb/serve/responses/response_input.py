"""A Responses request's `input` read as chat messages (`input_messages`): each item (`message` with
`input_text` / `input_image` parts, `function_call`, `function_call_output`, `reasoning`) validated on its
own, so that an item the server cannot read is a 400 naming its field (`input.2.content.1.image_url`), and
translated into the chat turn the chat path runs (serve/responses/responses_api.py builds the rest of the request).
A reasoning item waits for the assistant turn it belongs to; consecutive `function_call` items join one
assistant message's `tool_calls`, as chat holds them.
"""

from __future__ import annotations

import json
from typing import Literal, cast

from pydantic import BaseModel, Field, ValidationError

from ..chat.chat_media import decode_data_url, load_image
from ..protocol import ApiError, _Part

MAX_INPUT_ITEMS = 4096  # input items per request (and in a conversation continued by `previous_response_id`)
UNION_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict"})  # pydantic's names of union branches


def field_path(loc: tuple[int | str, ...]) -> list[str]:
    """A validation error's location without pydantic's union tags (`content.str` -> `content`)."""
    return [str(part) for part in loc if not (isinstance(part, str) and (part in UNION_TAGS or "[" in part))]


class ContentPart(_Part):
    type: Literal["input_text", "output_text", "text"]
    text: str


class ImageInputPart(_Part):
    """An `input_image` part: its `image_url` a data URL (serve/chat/chat_media.py reads no other); `file_id` (the
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


def _message_content(index: int, item: MessageItem) -> str | list[dict[str, object]]:
    """A message's chat content: its text, or with images chat's content parts (`text`, `image_url`), each
    image checked here so that a bad one is a 400 naming its input field (`input.0.content.1.image_url`)."""
    if isinstance(item.content, str) or not any(isinstance(p, ImageInputPart) for p in item.content):
        return _text(item.content)
    parts: list[dict[str, object]] = []
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


def input_messages(given: str | list[object]) -> list[dict[str, object]]:
    """The chat messages of a request's `input` (a 400 naming `input.i...` for an item it cannot read)."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    if len(given) > MAX_INPUT_ITEMS:
        raise ApiError(400, f"input: at most {MAX_INPUT_ITEMS} items, got {len(given)}", param="input")
    messages: list[dict[str, object]] = []
    reasoning: str | None = None  # a reasoning item waits for the assistant turn it belongs to
    for i, raw in enumerate(given):
        item = _item(i, raw)
        if isinstance(item, ReasoningItem):
            reasoning = "".join(part.text for part in item.content or item.summary)
        elif isinstance(item, MessageItem):
            message: dict[str, object] = {"role": item.role, "content": _message_content(i, item)}
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
            cast(list[object], last.setdefault("tool_calls", [])).append(call)
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
    return messages


def _item(index: int, raw: object) -> BaseModel:
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
        place = ".".join([where, *field_path(first["loc"])])
        raise ApiError(400, f"{place}: {first['msg']}", param=place) from None
