"""Units of tool calling and reasoning on the server: the request's tool fields checked (400s naming the field),
the assistant text split into reasoning, content and tool calls however it is chunked, the forced-call
schemas, transformers' response-template parser, and `--reasoning`'s template keywords."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.support.serve import MISSING, requires_serve

if MISSING:
    pytest.skip(requires_serve.kwargs["reason"], allow_module_level=True)

from hypothesis import given, settings
from hypothesis import strategies as st

from transformers_cb.serve.chat.reasoning import template_kwargs, thinks
from transformers_cb.serve.chat.tools import MAX_TOOLS, ToolMode, tool_mode
from transformers_cb.serve.chat.turn import (
    FallbackParser,
    ForcedParser,
    TemplateParser,
    TurnFormat,
    prompt_opens_thinking,
)
from transformers_cb.serve.protocol import ApiError, ChatCompletionRequest, ToolDefinition, parse_body

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}


def _mode(choice: Any = None, parallel: bool | None = None, tools: list[dict] | None = None) -> ToolMode:
    definitions = [
        ToolDefinition.model_validate(t) for t in (tools if tools is not None else [WEATHER, TIME])
    ]
    return tool_mode(definitions, choice, parallel)


def _run(parser: Any, pieces: list[str]) -> tuple[str, str, list[tuple[str, dict]]]:
    content, reasoning, calls = "", "", []
    for piece in pieces:
        delta = parser.push(piece)
        content, reasoning, calls = (
            content + delta.content,
            reasoning + delta.reasoning,
            calls + delta.tool_calls,
        )
    delta = parser.finish()
    content, reasoning, calls = content + delta.content, reasoning + delta.reasoning, calls + delta.tool_calls
    return content, reasoning, [(c.name, json.loads(c.arguments)) for c in calls]


def _chunks(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True) if b > a]


HERMES = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CASES = [
    # (reasoning, prompt opens <think>, text) -> (content, reasoning, calls)
    (False, False, HERMES, ("Let me check.\n", "", [("get_weather", {"city": "Paris"})])),
    (
        True,
        False,
        "<think>rain?</think>\n\n"
        + HERMES
        + '\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
        ("Let me check.\n\n", "rain?", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ),
    (True, True, "hmm, a < b</think>The answer.", ("The answer.", "hmm, a < b", [])),
    (True, False, "No thinking here <think>", ("No thinking here <think>", "", [])),
    (True, True, "cut short in thought", ("", "cut short in thought", [])),
    # Llama 3: the content is one JSON call with "parameters"
    (
        False,
        False,
        ' {"name": "get_weather", "parameters": {"city": "Oslo"}}',
        ("", "", [("get_weather", {"city": "Oslo"})]),
    ),
    # Mistral: [TOOL_CALLS] and a list (arguments as JSON text too)
    (
        False,
        False,
        '[TOOL_CALLS][{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}]',
        ("", "", [("get_time", {}), ("get_weather", {"city": "Rome"})]),
    ),
    # Markup that is not a call of a declared tool stays content, unchanged
    (
        False,
        False,
        '<tool_call>{"name": "launch", "arguments": {}}</tool_call>',
        ('<tool_call>{"name": "launch", "arguments": {}}</tool_call>', "", []),
    ),
    (False, False, "<tool_call>not json</tool_call> ok", ("<tool_call>not json</tool_call> ok", "", [])),
    (False, False, '{"a": 1} is JSON', ('{"a": 1} is JSON', "", [])),
    (False, False, "<tool_ca", ("<tool_ca", "", [])),
]


@pytest.mark.parametrize(("reasoning", "opens", "text", "expected"), CASES)
@settings(max_examples=25, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=12))
def test_the_split_is_the_same_however_the_text_is_chunked(
    reasoning: bool, opens: bool, text: str, expected: tuple, cuts: list[int]
) -> None:
    parser = FallbackParser(reasoning, _mode(), state="reasoning" if opens else "start")
    assert _run(parser, _chunks(text, cuts)) == expected


def test_without_tools_or_reasoning_nothing_is_parsed() -> None:
    turn = TurnFormat(_mode(tools=[]), reasoning=False)
    assert turn.parser() is None
    parser = FallbackParser(False, _mode("none"))
    assert _run(parser, [HERMES]) == (HERMES, "", [])


def test_without_parallel_tool_calls_only_the_first_call_is_kept() -> None:
    text = HERMES + '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    parser = FallbackParser(False, _mode(parallel=False))
    assert _run(parser, [text])[2] == [("get_weather", {"city": "Paris"})]


def test_a_prompt_that_leaves_think_open_starts_in_reasoning() -> None:
    assert prompt_opens_thinking("<|assistant|><think>\n")
    assert not prompt_opens_thinking("<|assistant|><think>\n\n</think>\n\n")
    assert not prompt_opens_thinking("<|assistant|>")


def test_forced_calls_parse_or_fall_back_to_content() -> None:
    named = _mode({"type": "function", "function": {"name": "get_weather"}})
    assert _run(ForcedParser(named), ['{"city": ', '"Lima"}']) == (
        "",
        "",
        [("get_weather", {"city": "Lima"})],
    )
    assert _run(ForcedParser(named), ['{"city": "Li']) == ('{"city": "Li', "", [])  # cut by max_tokens
    required = _mode("required")
    text = '[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "x"}}]'
    assert _run(ForcedParser(required), [text])[2] == [("get_time", {}), ("get_weather", {"city": "x"})]


def test_forced_schemas() -> None:
    named = _mode({"type": "function", "function": {"name": "get_weather"}}).guided()
    assert named is not None and named.json == WEATHER["function"]["parameters"]
    required = _mode("required", parallel=False).guided()
    assert required is not None and isinstance(required.json, dict)
    assert required.json["maxItems"] == 1 and required.json["minItems"] == 1
    branches = required.json["items"]["anyOf"]
    assert [b["properties"]["name"]["const"] for b in branches] == ["get_weather", "get_time"]
    assert _mode("auto").guided() is None and _mode("none").guided() is None


def _chat_body(**fields: Any) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}).encode()


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
        ({"tools": [WEATHER, WEATHER]}, "tools.1.function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
            "tools.0.function.parameters",
        ),
        ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
        ({"tools": [{"type": "function"}]}, "tools.0.function"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
            "tools.0.function.parameters",
        ),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(MAX_TOOLS + 1)]},
            "tools",
        ),
        ({"tools": [{"type": "function", "function": {"name": "f", "description": "x" * 300_000}}]}, "tools"),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"pad": "x" * 30_000}}, "chat_template_kwargs"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"messages": [{"role": "tool", "content": 3}]}, "messages.0.content.str"),
    ],
)
def test_bad_tool_fields_are_400s_naming_the_field(fields: dict, param: str) -> None:
    with pytest.raises(ApiError) as info:
        body = parse_body(_chat_body(**fields), ChatCompletionRequest)
        tool_mode(body.tools, body.tool_choice, body.parallel_tool_calls)
    assert info.value.status == 400
    assert info.value.param == param, info.value.message


RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|assistant|>",
    "fields": {
        "reasoning_content": {"open": "<think>", "close": "</think>", "content": "text"},
        "tool_calls": {
            "open_pattern": r"\s*<tool_call>",
            "close": "</tool_call>",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"\s*<\|end\|>", "content": "text"},
    },
}


def test_a_declared_response_template_is_read_by_transformers_parser() -> None:
    text = "<think>plan</think>" + HERMES
    for cuts in ([], [3, 9, 30, 50, 70]):
        parser = TemplateParser(RESPONSE_TEMPLATE, "<|user|>hi\n<|assistant|>", _mode())
        content, reasoning, calls = _run(parser, _chunks(text, cuts))
        assert reasoning == "plan"
        assert content.strip() == "Let me check."
        assert calls == [("get_weather", {"city": "Paris"})]


def test_reasoning_modes() -> None:
    class Tokenizer:
        chat_template = "{% if enable_thinking %}<think>{% endif %}"

    assert thinks("auto", Tokenizer()) and thinks("on", object()) and not thinks("off", Tokenizer())
    assert not thinks("auto", type("Plain", (), {"chat_template": "{{ messages }}"})())
    assert template_kwargs("auto", None, None) == {}
    assert template_kwargs("off", "low", None) == {"enable_thinking": False, "reasoning_effort": "low"}
    assert template_kwargs("on", None, {"enable_thinking": False}) == {"enable_thinking": False}


def test_without_reasoning_the_templates_reasoning_is_content() -> None:
    parser = TemplateParser(RESPONSE_TEMPLATE, "<|user|>hi\n<|assistant|>", _mode(), reasoning=False)
    content, reasoning, calls = _run(parser, ["<think>plan</think>", HERMES])
    assert reasoning == "" and content.startswith("plan") and "Let me check." in content
    assert calls == [("get_weather", {"city": "Paris"})]


def test_what_the_template_parser_cannot_read_is_content() -> None:
    parser = TemplateParser(RESPONSE_TEMPLATE, "<|user|>hi\n<|assistant|>", _mode())
    content, reasoning, calls = _run(
        parser, ["<think>plan</think>ok", '<tool_call>{"name": "get_time", "argu']
    )
    assert (reasoning, calls) == ("plan", []) and content.startswith("ok") and content.endswith('"argu')


def test_output_nested_past_pythons_limit_is_content() -> None:
    deep = "[" * 100_000
    assert _run(FallbackParser(False, _mode()), [deep]) == (deep, "", [])
    assert _run(ForcedParser(_mode("required")), [deep]) == (deep, "", [])
