"""Reasoning on the server: `--reasoning on|off|auto`, and the chat-template keywords a request sends.

`on`: templates are rendered with `enable_thinking=True` and the answer's reasoning is split into
`reasoning_content`. `off`: `enable_thinking=False`, nothing is split (the text is all content, as from a model
that does not think). `auto` (the default): the template's own default, and the split is made when the
model's template or tokenizer knows reasoning (its template mentions `<think>` or `enable_thinking`, or the
tokenizer declares a `response_template`). A request's `chat_template_kwargs` (e.g. `{"enable_thinking":
false}`) override the server's keywords; `reasoning_effort` reaches templates that take it. The split itself
is serve/chat/turn.py's.
"""

from __future__ import annotations

from typing import Any

REASONING_MODES = ("auto", "on", "off")
# What a chat template that thinks mentions (Qwen3, SmolLM3, DeepSeek-R1 and their kin).
THINKING_MARKS = ("<think>", "enable_thinking")


def thinks(mode: str, tokenizer: Any) -> bool:
    """Whether answers are split into reasoning and content under `--reasoning mode`."""
    if mode != "auto":
        return mode == "on"
    if getattr(tokenizer, "response_template", None) is not None:
        return True
    template = getattr(tokenizer, "chat_template", None)
    texts = template.values() if isinstance(template, dict) else [template or ""]
    return any(mark in text for text in texts for mark in THINKING_MARKS)


def template_kwargs(
    mode: str, reasoning_effort: str | None, request_kwargs: dict[str, object] | None
) -> dict[str, object]:
    """The keywords the chat template is rendered with: the server's, then the request's (which win)."""
    kwargs: dict[str, object] = {}
    if mode != "auto":
        kwargs["enable_thinking"] = mode == "on"
    if reasoning_effort is not None:
        kwargs["reasoning_effort"] = reasoning_effort
    kwargs.update(request_kwargs or {})
    return kwargs
