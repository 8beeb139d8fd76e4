"""An assistant turn's text split as it streams: reasoning, content and tool calls.

A chat choice's detokenized text (serve/events/choices.py) goes through one `MessageParser`, which says, piece by
piece, what is reasoning (`reasoning_content`), what is content and which tool calls were made:

- `TemplateParser`: the tokenizer declares its output format (`tokenizer.response_template`): transformers'
  own `ResponseParser` reads it (the same parser as `tokenizer.parse_response`), fed the prompt as prefix.
- `FallbackParser`: otherwise, the common formats. Reasoning is `<think> ... </think>` (Qwen3, SmolLM3,
  DeepSeek-R1), open from the start when the prompt ends inside an open `<think>`. Tool calls (with tools in
  `auto`): Hermes / Qwen `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` anywhere in the content,
  or, when the content *starts* with JSON, Llama 3's `{"name": ..., "parameters": {...}}` and Mistral's
  `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (one object or a list). Markup that does not parse
  as a call of a declared tool stays content, unchanged.
- `ForcedParser`: `tool_choice` required or a named function; the output was generated under the tool's
  schema (serve/chat/tools.py), so it is read as JSON, never searched for markup.

Text that may still turn into markup (a prefix of `<tool_call>` or `</think>`) is held back until it can be
told apart, so no delta is ever taken back.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from ..events.choices import ChoiceEvent, aclose
from .tools import ToolCall, ToolMode, new_call

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_MARK = "[TOOL_CALLS]"
# Response-template fields that hold reasoning (some templates on the Hub still name it `thinking`).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


@dataclass
class AssistantDelta:
    """What one piece of text turned out to be."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def extend(self, other: AssistantDelta) -> AssistantDelta:
        self.content += other.content
        self.reasoning += other.reasoning
        self.tool_calls += other.tool_calls
        return self


class MessageParser(Protocol):
    def push(self, text: str) -> AssistantDelta: ...

    def finish(self) -> AssistantDelta: ...


def prompt_opens_thinking(prompt_text: str) -> bool:
    """The rendered prompt leaves the assistant inside `<think>` (templates that pre-write it)."""
    return prompt_text.rfind(THINK_OPEN) > prompt_text.rfind(THINK_CLOSE)


def _held_prefix(text: str, marker: str) -> int:
    """How many trailing characters of `text` could be the start of `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def tool_calls_in(text: str, tools: ToolMode) -> list[ToolCall] | None:
    """The calls in `text` (one JSON object or a list of them, in any of the fallback formats), each naming a
    declared tool; None when it is not that (then it is content)."""
    body = text.strip()
    if body.startswith(MISTRAL_MARK):
        body = body[len(MISTRAL_MARK) :].strip()
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):  # not JSON, or nested past Python's limit
        return None
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in tools.names():
            return None
        arguments = item.get("arguments", item.get("parameters", {}))
        if isinstance(arguments, str):  # some models write the arguments as JSON text
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError):
                return None
        if not isinstance(arguments, dict):
            return None
        calls.append(new_call(item["name"], arguments))
    if not calls:
        return None
    return calls if tools.parallel else calls[:1]


@dataclass
class FallbackParser:
    """`<think>` reasoning and Hermes / Llama 3 / Mistral tool calls (see the module docstring).

    `state`: start (nothing but whitespace seen since the turn or the reasoning began), reasoning, content,
    tool (inside `<tool_call>`), json (the content began with a JSON call: read whole at the end)."""

    reasoning: bool  # split `<think>` reasoning
    tools: ToolMode
    state: str = "start"
    pending: str = ""  # text not told apart yet
    calls_made: int = 0

    def __post_init__(self) -> None:
        if self.state == "start" and not self.reasoning:
            self.state = "start_content"

    def push(self, text: str) -> AssistantDelta:
        self.pending += text
        out = AssistantDelta()
        while self.pending and self._step(out):
            pass
        return out

    def finish(self) -> AssistantDelta:
        out = AssistantDelta()
        text, self.pending = self.pending, ""
        if self.state == "reasoning":
            out.reasoning += text
        elif self.state in ("tool", "json"):
            calls = tool_calls_in(text[len(TOOL_OPEN) :] if self.state == "tool" else text, self.tools)
            if calls is None:
                out.content += text
            else:
                self._add_calls(out, calls)
        else:
            out.content += text.lstrip() if self.state in ("start", "start_content") else text
        return out

    def _step(self, out: AssistantDelta) -> bool:
        """Move what can be decided from `pending` into `out`; False when the rest must wait for more text."""
        if self.state in ("start", "start_content"):
            return self._start(out)
        if self.state == "reasoning":
            return self._until(THINK_CLOSE, out, "reasoning", after="start_content")
        if self.state == "content":
            if not self.tools.parses:
                out.content += self.pending
                self.pending = ""
                return False
            return self._until(TOOL_OPEN, out, "content", after="tool", keep_marker=True)
        if self.state == "tool":
            end = self.pending.find(TOOL_CLOSE)
            if end < 0:
                return False
            inside, self.pending = self.pending[len(TOOL_OPEN) : end], self.pending[end + len(TOOL_CLOSE) :]
            calls = tool_calls_in(inside, self.tools)
            if calls is None:
                out.content += TOOL_OPEN + inside + TOOL_CLOSE
            else:
                self._add_calls(out, calls)
            self.state = "content"
            return True
        return False  # json: read whole in `finish`

    def _start(self, out: AssistantDelta) -> bool:
        stripped = self.pending.lstrip()
        if not stripped:
            return False
        markers = [THINK_OPEN] if self.state == "start" else []
        if self.tools.parses:
            markers += [TOOL_OPEN, MISTRAL_MARK]
        for marker in markers:
            if marker.startswith(stripped) and len(stripped) < len(marker):
                return False  # could still be this marker
        if self.state == "start" and stripped.startswith(THINK_OPEN):
            self.pending, self.state = stripped[len(THINK_OPEN) :], "reasoning"
            return True
        if self.tools.parses and (stripped[0] in "{[" or stripped.startswith(MISTRAL_MARK)):
            self.pending, self.state = stripped, "json"
            return False
        self.pending, self.state = stripped, "content"
        return True

    def _until(
        self, marker: str, out: AssistantDelta, kind: str, after: str, keep_marker: bool = False
    ) -> bool:
        """Emit `pending` as `kind` up to `marker`, then switch to `after` (holding back a partial marker)."""
        at = self.pending.find(marker)
        if at < 0:
            keep = _held_prefix(self.pending, marker)
            ready, self.pending = (
                self.pending[: len(self.pending) - keep],
                self.pending[len(self.pending) - keep :],
            )
            setattr(out, kind, getattr(out, kind) + ready)
            return False
        setattr(out, kind, getattr(out, kind) + self.pending[:at])
        self.pending = self.pending[at:] if keep_marker else self.pending[at + len(marker) :]
        self.state = after
        return True

    def _add_calls(self, out: AssistantDelta, calls: list[ToolCall]) -> None:
        if not self.tools.parallel:
            calls = calls[: max(0, 1 - self.calls_made)]
        self.calls_made += len(calls)
        out.tool_calls += calls


@dataclass
class ForcedParser:
    """A `required` or named-function output: JSON under the tool's schema, read whole at the end. Cut short
    (`max_tokens`), it is returned as content."""

    tools: ToolMode
    text: str = ""

    def push(self, text: str) -> AssistantDelta:
        self.text += text
        return AssistantDelta()

    def finish(self) -> AssistantDelta:
        calls = self.tools.forced_calls(self.text)
        if calls is None:
            return AssistantDelta(content=self.text)
        return AssistantDelta(tool_calls=calls)


class TemplateParser:
    """transformers' `ResponseParser` on the tokenizer's `response_template` (fed the prompt as prefix).
    Without `reasoning` (`--reasoning off`), the reasoning it finds is content (its markers dropped)."""

    def __init__(
        self, template: dict[str, object], prompt_text: str, tools: ToolMode, reasoning: bool = True
    ) -> None:
        from transformers.utils.chat_parsing.response_parser import ResponseParser

        self.tools, self.reasoning = tools, reasoning
        self.parser: ResponseParser | None = ResponseParser(
            template, prefix=prompt_text, tools=[dict(tool) for tool in tools.tools] or None
        )
        self.first = self._read(self.parser.initial_events)
        self.unread = ""  # text fed since the parser last gave something: content if it fails on it

    def push(self, text: str) -> AssistantDelta:
        first, self.first = self.first, AssistantDelta()
        if self.parser is None:  # it failed earlier: the rest is content
            return first.extend(AssistantDelta(content=text))
        self.unread += text
        try:
            delta = self._read(self.parser.feed(text))
        except Exception:  # noqa: BLE001 - a region it cannot read (a malformed call): model output, not a bug
            return first.extend(self._give_up())
        if delta.content or delta.reasoning or delta.tool_calls:
            self.unread = ""
        return first.extend(delta)

    def finish(self) -> AssistantDelta:
        if self.parser is None:
            return AssistantDelta()
        try:
            _, events = self.parser.finalize()
        except Exception:  # noqa: BLE001 - e.g. a call cut short by max_tokens
            return self._give_up()
        return self._read(events)

    def _give_up(self) -> AssistantDelta:
        self.parser, unread, self.unread = None, self.unread, ""
        return AssistantDelta(content=unread)

    def _read(self, events: list[dict[str, object]]) -> AssistantDelta:
        out = AssistantDelta()
        for event in events:
            kind, name, text = event["type"], event.get("field"), event.get("text")
            if kind == "region_chunk" and not event.get("dirty") and isinstance(text, str) and text:
                if name in REASONING_FIELDS and self.reasoning:
                    out.reasoning += text
                elif name == "content" or name in REASONING_FIELDS:
                    out.content += text
            elif kind == "region_close" and name == "tool_calls" and self.tools.parses:
                value = event.get("value") or {}
                function = value.get("function", value) if isinstance(value, dict) else {}
                if function.get("name") in self.tools.names():
                    out.tool_calls.append(new_call(function["name"], function.get("arguments", {})))
        return out


@dataclass(frozen=True)
class TurnFormat:
    """How a chat request's answer is read: its tools, whether reasoning is split, the prompt it follows."""

    tools: ToolMode
    reasoning: bool  # `reasoning_content` is split from the content (and present in the answer)
    prompt_text: str = ""
    response_template: dict[str, object] | None = None  # the tokenizer's, if it declares one

    def parser(self) -> MessageParser | None:
        """A fresh parser for one choice (None: the text is all content, as without this feature)."""
        if self.tools.forced:
            return ForcedParser(self.tools)
        if not (self.reasoning or self.tools.parses):
            return None
        if self.response_template is not None:
            return TemplateParser(self.response_template, self.prompt_text, self.tools, self.reasoning)
        opens = self.reasoning and prompt_opens_thinking(self.prompt_text)
        return FallbackParser(self.reasoning, self.tools, state="reasoning" if opens else "start")


async def split_events(events: AsyncIterator[ChoiceEvent], turn: TurnFormat) -> AsyncIterator[ChoiceEvent]:
    """`events` with each choice's text split by its own parser; a choice that made a tool call and stopped
    finishes with `finish_reason="tool_calls"`."""
    parsers: dict[int, MessageParser | None] = {}
    called: set[int] = set()
    try:
        async for event in events:
            if event.index not in parsers:
                parsers[event.index] = turn.parser()
            parser = parsers[event.index]
            if parser is None or event.error is not None:
                yield event
                continue
            delta = parser.push(event.text)
            if event.is_last:
                delta.extend(parser.finish())
            event.text, event.reasoning, event.tool_calls = delta.content, delta.reasoning, delta.tool_calls
            if delta.tool_calls:
                called.add(event.index)
            if event.finish_reason == "stop" and event.index in called:
                event.finish_reason = "tool_calls"
            yield event
    finally:
        await aclose(events)
