"""Tool calling and reasoning through the server, with the official `openai` client, on the tiny model with a
chat template that renders `tools`, tool calls and `tool` turns and thinks (`<think>`): the client's tool loop
(call, `tool` message, answer), forced calls valid against their schema (a property test over random schemas),
parsed Hermes calls and the reasoning split, streamed and not; bad tool fields are 400s naming the field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.serve import (
    MISSING,
    MODEL_NAME,
    LiveServer,
    live_server,
    openai_client,
    prompt_tokens,
    requires_serve,
    tiny_model_and_tokenizer,
)

if MISSING:
    pytest.skip(requires_serve.kwargs["reason"], allow_module_level=True)
openai = pytest.importorskip("openai", reason="the official openai client is in the test extra")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

# Renders the tools, earlier tool calls and tool turns; thinks unless `enable_thinking` is false (as Qwen3).
TOOL_TEMPLATE = (
    "{% if tools %}<|system|>tools:{% for t in tools %} {{ t.function.name }}{% endfor %}\n{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
    "{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}"
    "{% endif %}"
)
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER_PARAMETERS},
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
        },
    },
]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
MAX_TOKENS = 120


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    model, tokenizer = tiny_model_and_tokenizer()
    tokenizer.chat_template = TOOL_TEMPLATE
    with live_server(model, tokenizer) as live:
        yield live


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Any:
    return openai_client(server)


def test_the_openai_clients_tool_loop_runs_unchanged(server: LiveServer, client: Any) -> None:
    messages: list[Any] = list(MESSAGES)
    named = {"type": "function", "function": {"name": "get_weather"}}
    first = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, tools=TOOLS, tool_choice=named, max_tokens=MAX_TOKENS
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER_PARAMETERS)
    assert first.usage.prompt_tokens == prompt_tokens(server, messages, tools=TOOLS)

    # The loop as the client's docs write it: the assistant message as returned, then the tool's answer.
    messages.append(choice.message)
    messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp": 21})})
    second = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        tools=TOOLS,
        tool_choice="none",
        max_tokens=8,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    answer = second.choices[0]
    assert answer.finish_reason in ("stop", "length") and answer.message.tool_calls is None
    assert answer.message.content  # the answer, not reasoning: thinking was off
    rendered = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": arguments},
                }
            ],
        },
        messages[-1],
    ]
    assert second.usage.prompt_tokens == prompt_tokens(server, rendered, tools=TOOLS, enable_thinking=False)


def test_required_streams_tool_call_deltas(client: Any) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice="required",
            max_tokens=MAX_TOKENS,
            stream=True,
            parallel_tool_calls=False,
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls: dict[int, dict[str, str]] = {}
    for delta in deltas:
        for part in delta.tool_calls or []:
            entry = calls.setdefault(part.index, {"name": "", "arguments": "", "id": ""})
            entry["id"] += part.id or ""
            entry["name"] += part.function.name or ""
            entry["arguments"] += part.function.arguments or ""
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert list(calls) == [0]  # parallel_tool_calls=false: one call
    parameters = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    jsonschema.validate(json.loads(calls[0]["arguments"]), parameters[calls[0]["name"]])
    assert not any(d.content for d in deltas)


SCALARS = st.one_of(
    st.just({"type": "boolean"}),
    st.builds(
        lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
        st.integers(-50, 50),
        st.integers(0, 100),
    ),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
    st.lists(st.sampled_from(["a", "b", "red", "x y", "7"]), min_size=1, max_size=4, unique=True).map(
        lambda e: {"enum": e}
    ),
    st.just({"type": "null"}),
)


def _objects(children: Any) -> Any:
    keys = st.lists(
        st.sampled_from(["a", "b", "city", "n", "flag", "when"]), min_size=0, max_size=4, unique=True
    )

    def build(names: list[str], values: list[dict], data: Any) -> dict:
        required = [n for n in names if data.draw(st.booleans())]
        return {
            "type": "object",
            "properties": dict(zip(names, values, strict=False)),
            "required": required,
            "additionalProperties": False,
        }

    return keys.flatmap(
        lambda names: st.builds(
            build, st.just(names), st.lists(children, min_size=len(names), max_size=len(names)), st.data()
        )
    )


VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        _objects(inner), st.builds(lambda s: {"type": "array", "items": s, "maxItems": 2}, inner)
    ),
    max_leaves=6,
)
PARAMETERS = _objects(VALUES)


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(parameters=PARAMETERS, other=PARAMETERS, required=st.booleans(), seed=st.integers(0, 2**31))
def test_forced_calls_always_parse_against_their_schema(
    client: Any, parameters: dict, other: dict, required: bool, seed: int
) -> None:
    tools = [
        {"type": "function", "function": {"name": "f", "parameters": parameters}},
        {"type": "function", "function": {"name": "g", "parameters": other}},
    ]
    choice: Any = "required" if required else {"type": "function", "function": {"name": "f"}}
    # One call at most (`maxItems` 1): the schemas bound every value, so the output is bounded and must end
    # within max_tokens; only that cap could cut a forced call short (then finish_reason is "length").
    response = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=False,
        max_tokens=600,
        seed=seed,
    )
    result = response.choices[0]
    assert result.finish_reason == "tool_calls", result
    assert result.message.tool_calls
    schemas = {"f": parameters, "g": other}
    for call in result.message.tool_calls:
        assert required or call.function.name == "f"
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


HERMES_REGEX = r'[a-z]{2,6}</think>\n<tool_call>\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,6}", "days": [1-7]\}\}</tool_call>'


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_auto_parses_the_models_own_markup_and_splits_reasoning(client: Any, stream: bool) -> None:
    # The random model is steered into a thought and a Hermes call by a regex: what a real one writes unaided.
    kwargs: dict[str, Any] = {
        "model": MODEL_NAME,
        "messages": MESSAGES,
        "tools": TOOLS,
        "max_tokens": MAX_TOKENS,
    }
    kwargs["extra_body"] = {"guided_regex": HERMES_REGEX}
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        reasoning = choice.message.model_extra["reasoning_content"]
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
        finish, content = choice.finish_reason, choice.message.content
    else:
        chunks = [c for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
        deltas = [c.choices[0].delta for c in chunks]
        reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
        content = "".join(d.content or "" for d in deltas) or None
        parts = [p for d in deltas for p in d.tool_calls or []]
        assert [p.index for p in parts] == [0]
        calls = [(p.function.name, json.loads(p.function.arguments)) for p in parts]
        finish = chunks[-1].choices[0].finish_reason
        # no delta carries both reasoning and content
        assert not any(d.content and (d.model_extra or {}).get("reasoning_content") for d in deltas)
    assert finish == "tool_calls"
    assert reasoning and reasoning.isalpha()
    assert content is None
    ((name, arguments),) = calls
    assert name == "get_weather"
    jsonschema.validate(arguments, WEATHER_PARAMETERS)


def test_reasoning_content_is_split_from_the_content(client: Any) -> None:
    body = {"guided_regex": r"[a-z]{3,6}</think>[a-z]{3,6}"}
    choice = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=40, extra_body=body
    ).choices[0]
    reasoning, content = choice.message.model_extra["reasoning_content"], choice.message.content
    assert reasoning.isalpha() and content.isalpha() and 3 <= len(reasoning) <= 6
    # Thinking off in the template: the prompt closes <think>, so the same output is all content.
    off = {**body, "chat_template_kwargs": {"enable_thinking": False}}
    choice = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=40, extra_body=off
    ).choices[0]
    assert choice.message.model_extra["reasoning_content"] is None
    assert "</think>" in choice.message.content


def test_reasoning_off_on_the_server_leaves_the_text_whole(server: LiveServer, client: Any) -> None:
    server.state.reasoning = "off"
    try:
        body = {"guided_regex": r"[a-z]{3,6}</think>[a-z]{3,6}"}
        choice = client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=40, extra_body=body
        ).choices[0]
    finally:
        server.state.reasoning = "auto"
    assert "reasoning_content" not in (choice.message.model_extra or {})
    assert "</think>" in choice.message.content


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "unknown"}}},
            "tool_choice",
        ),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]}, "tools"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"a": {"type": "bogus"}}},
                        },
                    }
                ],
                "tool_choice": "required",
            },
            "tools",
        ),
        ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}
                        ],
                    }
                ]
            },
            "messages",
        ),
    ],
)
def test_bad_tool_requests_are_400s_naming_the_field(client: Any, fields: dict, param: str) -> None:
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 4, **fields}
    with pytest.raises(openai.BadRequestError) as info:
        client.post("/chat/completions", body=body, cast_to=object)
    assert info.value.body["param"] == param, info.value.body
    # ... and the server keeps serving
    assert client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2).choices


def test_a_declared_response_template_is_used_on_the_server(server: LiveServer, client: Any) -> None:
    from tests.serve.test_tool_parsing import RESPONSE_TEMPLATE

    tokenizer = server.state.tokenizer
    tokenizer.response_template = {**RESPONSE_TEMPLATE, "start_anchor": "<|assistant|>"}
    regex = r'[a-z]{2,6}</think>ok<tool_call>\{"name": "get_time", "arguments": \{\}\}</tool_call>'
    body = {"model": MODEL_NAME, "messages": MESSAGES, "tools": TOOLS, "extra_body": {"guided_regex": regex}}
    try:
        choice = client.chat.completions.create(max_tokens=MAX_TOKENS, **body).choices[0]
        # Cut short inside the call (the output is 76 tokens): what the parser could not read is content.
        cut = client.chat.completions.create(max_tokens=60, **body).choices[0]
    finally:
        del tokenizer.response_template
    assert choice.finish_reason == "tool_calls"
    assert choice.message.model_extra["reasoning_content"].strip().isalpha()
    assert choice.message.content == "ok"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_time", {})
    ]
    assert cut.finish_reason == "length" and cut.message.tool_calls is None
    assert cut.message.content.startswith("ok<tool_call>{")


def test_each_of_n_choices_makes_its_own_calls(client: Any) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice=named,
            max_tokens=MAX_TOKENS,
            n=2,
            seed=3,
            stream=True,
        )
    )
    calls: dict[int, list[Any]] = {0: [], 1: []}
    finish: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            calls[choice.index] += choice.delta.tool_calls or []
            finish[choice.index] = choice.finish_reason or finish.get(choice.index, "")
    assert finish == {0: "tool_calls", 1: "tool_calls"}
    for parts in calls.values():
        assert [p.index for p in parts] == [0]  # indices count each choice's own calls
        jsonschema.validate(json.loads(parts[0].function.arguments), WEATHER_PARAMETERS)
    assert calls[0][0].id != calls[1][0].id
