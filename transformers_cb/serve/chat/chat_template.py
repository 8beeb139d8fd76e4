"""A chat request's messages rendered through the tokenizer's chat template: each message as templates
know it (OpenAI's "developer" role as "system", tool calls with their arguments as a mapping), the tools and
the template keywords; a template that rejects the messages is the client's 400, naming `messages`.

Apart from serve/app.py's request flow: the rendering needs the tokenizer and the request only. The template
itself runs in `jobs/prompts.py` `render_chat`, the rendering `transformers-cb generate --chat` and its Ray
replicas use.
"""

from __future__ import annotations

import json
from typing import Any

from ...jobs.prompts import render_chat
from ..protocol import ApiError, ChatCompletionRequest
from .reasoning import template_kwargs
from .tools import ToolMode


def chat_text(
    tokenizer: Any, model_name: str, reasoning: str, body: ChatCompletionRequest, tools: ToolMode
) -> str:
    """The rendered prompt: the messages (tool turns and earlier tool calls included), the tools, and the
    template keywords (`--reasoning`, `reasoning_effort`, the request's `chat_template_kwargs`)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ApiError(
            400,
            f"the model {model_name!r} has no chat template: use /v1/completions, or start the "
            "server with --chat-template FILE",
            param="messages",
        )
    messages = [_template_message(m) for m in body.messages]
    kwargs = template_kwargs(reasoning, body.reasoning_effort, body.chat_template_kwargs)
    if tools.tools:
        kwargs["tools"] = list(tools.tools)
    try:
        return render_chat(tokenizer, messages, True, **kwargs)
    except Exception as error:  # noqa: BLE001 - a template's own check (e.g. role order) is bad input
        raise ApiError(400, f"the chat template rejected the messages: {error}", param="messages") from None


def _template_message(message: Any) -> dict[str, object]:
    # OpenAI's "developer" role is the newer name of "system", which is what templates know.
    rendered: dict[str, object] = {
        "role": "system" if message.role == "developer" else message.role,
        "content": message.text(),
    }
    if message.name is not None:
        rendered["name"] = message.name
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    if message.reasoning_content is not None:
        rendered["reasoning_content"] = message.reasoning_content
    if message.tool_calls:
        # Templates iterate the arguments as a mapping (transformers serve does the same).
        rendered["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": _arguments(call.function.arguments)},
            }
            for call in message.tool_calls
        ]
    return rendered


def _arguments(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise ApiError(
            400, "messages: a tool call's function.arguments is not JSON text", param="messages"
        ) from None
