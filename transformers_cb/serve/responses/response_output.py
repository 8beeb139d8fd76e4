"""A Responses answer's output items, built from one choice's events (`OutputItems`): `reasoning`,
`message` and `function_call` items, each opened, filled and closed as the events come, and the stream
events each step makes (serve/responses/response_stream.py numbers and frames them). A streamed response and a whole
one hold the same items because both are this one object; `message` gives the assistant turn they are,
for `previous_response_id`.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from ..chat.tools import ToolCall
from ..events.choices import ChoiceEvent


@dataclass
class OutputItems:
    """One choice's output as Responses items, built from its events; `add` and `finish` return the stream
    events each step makes (without `sequence_number`, which the stream numbers)."""

    items: list[dict[str, Any]] = field(default_factory=list)  # read back by `message`
    open_kind: str | None = None  # "reasoning" or "message": the item text is being added to
    reasoning_text: str = ""
    message_text: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str | None = None
    num_generated: int = 0

    @property
    def status(self) -> str:
        return "incomplete" if self.finish_reason == "length" else "completed"

    def add(self, event: ChoiceEvent) -> list[dict[str, object]]:
        out: list[dict[str, object]] = []
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

    def finish(self) -> list[dict[str, object]]:
        out = self._close()
        if not self.items:  # nothing at all: still one (empty) message, as a chat turn has content
            out += self._open("message") + self._close()
        return out

    def _text(self, kind: str, text: str) -> list[dict[str, object]]:
        out = self._close() if self.open_kind not in (None, kind) else []
        if self.open_kind is None:
            out += self._open(kind)
        item = self.items[-1]
        if kind == "reasoning":
            self.reasoning_text += text
            delta: dict[str, object] = {"type": "response.reasoning_text.delta", "delta": text}
        else:
            self.message_text += text
            delta = {"type": "response.output_text.delta", "delta": text, "logprobs": []}
        return [
            *out,
            {**delta, "item_id": item["id"], "output_index": len(self.items) - 1, "content_index": 0},
        ]

    def _open(self, kind: str) -> list[dict[str, object]]:
        self.open_kind = kind
        if kind == "reasoning":
            self.reasoning_text = ""
            item = {"id": "rs_" + uuid.uuid4().hex, "type": "reasoning", "summary": [], "content": []}
            part: dict[str, object] = {"type": "reasoning_text", "text": ""}
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

    def _close(self) -> list[dict[str, object]]:
        kind, self.open_kind = self.open_kind, None
        if kind is None:
            return []
        item, where = self.items[-1], {"output_index": len(self.items) - 1}
        if kind == "reasoning":
            part: dict[str, object] = {"type": "reasoning_text", "text": self.reasoning_text}
            done: dict[str, object] = {"type": "response.reasoning_text.done", "text": self.reasoning_text}
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

    def _call(self, call: ToolCall) -> list[dict[str, object]]:
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

    def message(self) -> dict[str, object]:
        """The assistant turn these items are, as a chat message (what `previous_response_id` continues)."""
        text = "".join(
            part["text"] for item in self.items if item["type"] == "message" for part in item["content"]
        )
        reasoning = "".join(
            part["text"] for item in self.items if item["type"] == "reasoning" for part in item["content"]
        )
        message: dict[str, object] = {"role": "assistant", "content": text or None}
        if reasoning:
            message["reasoning_content"] = reasoning
        if self.calls:
            message["tool_calls"] = [call.wire() for call in self.calls]
        elif message["content"] is None:
            message["content"] = ""
        return message
