"""Shaping choice events into OpenAI response bodies and SSE chunks (completions and chat)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from ..chat.tools import ToolCall
from .choices import ChoiceEvent


@dataclass
class ChoiceTotals:
    """What a choice has produced so far. Adding an event costs what the event carries (the text is kept
    in pieces, joined when read), so a long stream's totals cost O(N)."""

    text_pieces: list[str] = field(default_factory=list)
    text_length: int = 0  # characters of `text`
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    num_generated: int = 0  # `token_ids` less the echoed prompt
    finish_reason: str | None = None
    reasoning_pieces: list[str] = field(default_factory=list)  # chat with reasoning split
    tool_calls: list[ToolCall] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.text_pieces)

    def add(self, event: ChoiceEvent) -> None:
        if event.text:
            self.text_pieces.append(event.text)
            self.text_length += len(event.text)
        self.token_ids += event.token_ids
        self.logprobs += event.logprobs
        self.top_logprobs += event.top_logprobs
        self.num_generated += event.num_generated
        self.finish_reason = event.finish_reason or self.finish_reason
        if event.reasoning:
            self.reasoning_pieces.append(event.reasoning)
        self.tool_calls += event.tool_calls

    def message(self, reasoning: bool) -> dict[str, object]:
        """The chat `message`: content (None when the turn is only tool calls), tool calls, reasoning."""
        text = self.text
        message: dict[str, object] = {"role": "assistant", "content": text}
        if self.tool_calls:
            message["content"] = text if text.strip() else None
            message["tool_calls"] = [call.wire() for call in self.tool_calls]
        if reasoning:
            message["reasoning_content"] = "".join(self.reasoning_pieces) or None
        return message


@dataclass
class ResponseShape:
    """Everything one response needs besides its events: ids, model, the kind of endpoint."""

    kind: str  # "completion" or "chat"
    response_id: str
    model: str
    tokenizer: Any
    want_logprobs: bool
    num_prompt_tokens: int
    top_logprobs: int = 0  # alternatives per token (completions: `logprobs=k`; chat: `top_logprobs`)
    continuous_usage: bool = False  # `stream_options.continuous_usage_stats`: usage in every chunk
    reasoning: bool = False  # chat: `reasoning_content` is split from the content
    created: int = field(default_factory=lambda: int(time.time()))

    # -- logprobs ---------------------------------------------------------------
    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def logprobs(
        self,
        token_ids: list[int],
        logprobs: list[float | None],
        text_offset: int = 0,
        tops: list[dict[int, float] | None] | None = None,
    ) -> Any:
        if not self.want_logprobs:
            return None
        tokens = [self._token_text(t) for t in token_ids]
        tops = tops if tops and self.top_logprobs else [None] * len(tokens)
        if self.kind == "chat":
            return {
                "content": [
                    {
                        "token": s,
                        "logprob": lp,
                        "bytes": list(s.encode("utf-8")),
                        "top_logprobs": [
                            {"token": alt, "logprob": v, "bytes": list(alt.encode("utf-8"))}
                            for alt, v in ((self._token_text(i), v) for i, v in (top or {}).items())
                        ],
                    }
                    for s, lp, top in zip(tokens, logprobs, tops, strict=True)
                ]
            }
        offsets, position = [], text_offset
        for s in tokens:
            offsets.append(position)
            position += len(s)
        top_field = None
        if self.top_logprobs:
            top_field = [
                self._completion_top(t, lp, top) for t, lp, top in zip(token_ids, logprobs, tops, strict=True)
            ]
        return {
            "tokens": tokens,
            "token_logprobs": logprobs,
            "top_logprobs": top_field,
            "text_offset": offsets,
        }

    def _completion_top(
        self, token_id: int, logprob: float | None, top: dict[int, float] | None
    ) -> dict[str, float] | None:
        """OpenAI's legacy form: the k best by token text, plus the chosen token (up to k + 1)."""
        if top is None:
            return None  # the first prompt token: nothing predicts it
        alternatives: dict[str, float] = {}
        for i, v in top.items():  # best first: tokens sharing a text (e.g. partial bytes) keep the best
            alternatives.setdefault(self._token_text(i), v)
        if logprob is not None:
            alternatives.setdefault(self._token_text(token_id), logprob)
        return alternatives

    def usage(self, totals: dict[int, ChoiceTotals]) -> dict[str, int]:
        completion = sum(t.num_generated for t in totals.values())
        return {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.num_prompt_tokens + completion,
        }

    # -- whole responses ----------------------------------------------------------
    def body(self, totals: dict[int, ChoiceTotals]) -> dict[str, object]:
        choices = []
        for index in sorted(totals):
            t = totals[index]
            choice: dict[str, object] = {"index": index, "finish_reason": t.finish_reason}
            choice["logprobs"] = self.logprobs(t.token_ids, t.logprobs, tops=t.top_logprobs)
            if self.kind == "chat":
                choice["message"] = t.message(self.reasoning)
            else:
                choice["text"] = t.text
            choices.append(choice)
        return {
            "id": self.response_id,
            "object": "chat.completion" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(totals),
        }

    # -- streaming ----------------------------------------------------------------
    def chunk(
        self,
        event: ChoiceEvent | None,
        include_usage: bool,
        text_offset: int = 0,
        role: bool = False,
        tool_offset: int = 0,
    ) -> dict[str, object]:
        """One SSE chunk for `event` (or, with `event=None`, the choice-less chunk used for usage)."""
        chunk: dict[str, object] = {
            "id": self.response_id,
            "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [],
        }
        if event is not None:
            choice: dict[str, object] = {"index": event.index, "finish_reason": event.finish_reason}
            choice["logprobs"] = (
                None
                if role
                else self.logprobs(event.token_ids, event.logprobs, text_offset, event.top_logprobs)
            )
            if self.kind == "chat":
                choice["delta"] = {"role": "assistant", "content": ""} if role else _delta(event, tool_offset)
            else:
                choice["text"] = event.text
            chunk["choices"] = [choice]
        if include_usage:
            chunk["usage"] = None
        return chunk


def _delta(event: ChoiceEvent, tool_offset: int) -> dict[str, object]:
    """A chat delta: its content, reasoning and tool calls (each call whole, `index` counting the choice's
    calls from `tool_offset`)."""
    delta: dict[str, object] = {}
    if event.text or not (event.reasoning or event.tool_calls):
        delta["content"] = event.text
    if event.reasoning:
        delta["reasoning_content"] = event.reasoning
    if event.tool_calls:
        delta["tool_calls"] = [call.wire(tool_offset + i) for i, call in enumerate(event.tool_calls)]
    return delta


# Line separators JSON leaves raw in a string: a client that splits the stream with a universal-newline reader
# (httpx's `aiter_lines`, Python's `str.splitlines`) would cut an event in two at them, although SSE ends lines
# at CR and LF only. Escaped, they decode to the same text (benchmarks/soak.py met one from the tiny model).
_SEPARATORS = {"\u0085": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"}


def sse(data: dict[str, object] | str) -> bytes:
    """One server-sent event carrying `data` (a JSON object, or the literal `[DONE]`)."""
    if isinstance(data, str):
        payload = data
    else:
        payload = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
        for raw, escaped in _SEPARATORS.items():
            if raw in payload:
                payload = payload.replace(raw, escaped)
    return f"data: {payload}\n\n".encode()
