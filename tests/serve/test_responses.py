"""`/v1/responses` with the official `openai` client's `responses.create`, streamed and not, on the tiny model
with a chat template that renders tools, tool calls and tool turns and thinks: a response is the chat turn of
the same conversation (same prompt, same greedy text and reasoning), a stream's events build the same items as
a whole response, tool calls are `function_call` items the client answers with `function_call_output`,
`previous_response_id` continues a stored conversation; bad ids, items and oversized inputs are 4xx naming
the field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.serve.test_tools import TOOL_TEMPLATE, WEATHER_PARAMETERS
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
from tests.support.threads import TIMEOUT

if MISSING:
    pytest.skip(requires_serve.kwargs["reason"], allow_module_level=True)
openai = pytest.importorskip("openai", reason="the official openai client is in the test extra")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from transformers_cb.serve.protocol import ApiError  # noqa: E402
from transformers_cb.serve.responses.response_input import input_messages  # noqa: E402
from transformers_cb.serve.responses.responses_api import ResponseStore, new_response_id  # noqa: E402

TOOLS = [
    {"type": "function", "name": "get_weather", "description": "Weather", "parameters": WEATHER_PARAMETERS}
]
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER_PARAMETERS},
    }
]
INSTRUCTIONS = "Answer briefly."
# Keys a fuzzed item or field may hold: the real ones, so that some bodies get far into the translation.
KEYS = [
    "type",
    "role",
    "content",
    "text",
    "call_id",
    "name",
    "arguments",
    "output",
    "summary",
    "format",
    "effort",
    "parameters",
    "schema",
    "function",
]


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    model, tokenizer = tiny_model_and_tokenizer()
    tokenizer.chat_template = TOOL_TEMPLATE
    with live_server(model, tokenizer) as live:
        yield live


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Any:
    return openai_client(server)


def _texts(response: Any) -> tuple[str, str]:
    """(reasoning, output text) of a response's items."""
    reasoning = "".join(
        c.text for item in response.output if item.type == "reasoning" for c in item.content or []
    )
    return reasoning, response.output_text


def test_a_response_is_the_chat_turn_of_its_conversation(server: LiveServer, client: Any) -> None:
    response = client.responses.create(
        model=MODEL_NAME, instructions=INSTRUCTIONS, input="Hello there", max_output_tokens=12, temperature=0
    )
    messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "Hello there"}]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=12, temperature=0)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.usage.input_tokens == chat.usage.prompt_tokens == prompt_tokens(server, messages)
    assert response.usage.output_tokens == chat.usage.completion_tokens
    message = chat.choices[0].message
    assert _texts(response) == (getattr(message, "reasoning_content", None) or "", message.content or "")
    finished = chat.choices[0].finish_reason
    assert response.status == ("incomplete" if finished == "length" else "completed")
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"


def test_the_stream_builds_the_same_response(client: Any) -> None:
    kwargs = {
        "model": MODEL_NAME,
        "input": [{"role": "user", "content": "Tell me"}],
        "max_output_tokens": 16,
        "temperature": 0,
    }
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    thinking = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert (thinking, deltas) == _texts(final) == _texts(whole)
    assert [item.type for item in final.output] == [item.type for item in whole.output]
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [item.id for item in done] == [item.id for item in final.output]
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_function_calls_and_their_outputs_round_trip(server: LiveServer, client: Any) -> None:
    first = client.responses.create(
        model=MODEL_NAME,
        input="Weather in Paris?",
        tools=TOOLS,
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=120,
    )
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and first.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)

    second = client.responses.create(
        model=MODEL_NAME,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "21C"}],
        tools=TOOLS,
        tool_choice="none",
        max_output_tokens=4,
    )
    reasoning = _texts(first)[0]
    assistant: dict[str, Any] = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": call.call_id,
                "type": "function",
                "function": {"name": call.name, "arguments": json.loads(call.arguments)},
            }
        ],
    }
    if reasoning:
        assistant["reasoning_content"] = reasoning
    rendered = [
        {"role": "user", "content": "Weather in Paris?"},
        assistant,
        {"role": "tool", "tool_call_id": call.call_id, "content": "21C"},
    ]
    assert second.usage.input_tokens == prompt_tokens(server, rendered, tools=CHAT_TOOLS)
    assert second.previous_response_id == first.id


def test_the_client_can_send_back_the_output_items_itself(server: LiveServer, client: Any) -> None:
    first = client.responses.create(
        model=MODEL_NAME,
        input="Weather?",
        tools=TOOLS,
        tool_choice="required",
        max_output_tokens=120,
        store=False,
    )
    (call,) = [item for item in first.output if item.type == "function_call"]
    items = [
        {"role": "user", "content": "Weather?"},
        *[i.model_dump(exclude_none=True) for i in first.output],
    ]
    items.append({"type": "function_call_output", "call_id": call.call_id, "output": "sunny"})
    stream = client.responses.create(
        model=MODEL_NAME, input=items, tools=TOOLS, max_output_tokens=4, stream=True
    )
    final = list(stream)[-1].response
    assert final.status in ("completed", "incomplete")
    with pytest.raises(openai.NotFoundError):  # store=False: nothing to continue
        client.responses.create(
            model=MODEL_NAME, previous_response_id=first.id, input="more", max_output_tokens=2
        )


def test_previous_response_id_continues_the_conversation_without_its_instructions(
    server: LiveServer, client: Any
) -> None:
    first = client.responses.create(
        model=MODEL_NAME, instructions=INSTRUCTIONS, input="One", max_output_tokens=6, temperature=0
    )
    second = client.responses.create(
        model=MODEL_NAME, previous_response_id=first.id, input="Two", max_output_tokens=6, temperature=0
    )
    reasoning, text = _texts(first)
    assistant: dict[str, Any] = {"role": "assistant", "content": text or None}
    if reasoning:
        assistant["reasoning_content"] = reasoning
    if not text:
        assistant["content"] = ""
    rendered = [{"role": "user", "content": "One"}, assistant, {"role": "user", "content": "Two"}]
    assert second.usage.input_tokens == prompt_tokens(server, rendered)


def _error(client: Any, status: int, **kwargs: Any) -> Any:
    kwargs = {"model": MODEL_NAME, "input": "hi", "max_output_tokens": 2, **kwargs}
    with pytest.raises(openai.APIStatusError) as caught:
        client.responses.create(**kwargs)
    assert caught.value.status_code == status, caught.value.body
    return caught.value.body


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"previous_response_id": "nope"}, "previous_response_id"),
        ({"previous_response_id": "resp_" + "z" * 32}, "previous_response_id"),
        ({"previous_response_id": "resp_" + "0" * 32}, "previous_response_id"),
        ({"input": [{"type": "image_generation_call"}]}, "input.0.type"),
        ({"input": ["text"]}, "input.0"),
        ({"input": [{"role": "wizard", "content": "x"}]}, "input.0.role"),
        ({"input": [{"role": "user"}]}, "input.0.content"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input.0.content.0.image_url",  # not a data URL (images: tests/serve/test_media.py)
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input.0.content",
        ),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
            "input.0.arguments",
        ),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0.call_id"),
        ({"input": []}, "input"),
        ({"input": [{"role": "user", "content": "x"}] * 5000}, "input"),
        ({"input": "word " * 5000}, "input"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"tools": [{"type": "function", "name": "bad name!"}]}, "tools.0.name"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"temperature": 3}, "temperature"),
        ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ],
)
def test_bad_requests_are_400s_naming_the_field(client: Any, kwargs: dict[str, Any], param: str) -> None:
    status = 404 if kwargs.get("previous_response_id") == "resp_" + "0" * 32 else 400
    body = _error(client, status, **kwargs)
    error = body.get("error", body) if isinstance(body, dict) else body
    assert error["param"] == param, error


def test_the_server_still_serves_after_the_bad_requests(client: Any) -> None:
    assert client.responses.create(model=MODEL_NAME, input="ok", max_output_tokens=2).status in (
        "completed",
        "incomplete",
    )


def test_a_json_schema_text_format_constrains_the_output(client: Any) -> None:
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
        "additionalProperties": False,
    }
    response = client.responses.create(
        model=MODEL_NAME,
        input="A number",
        text={"format": {"type": "json_schema", "name": "num", "schema": schema}},
        max_output_tokens=40,
    )
    if response.status == "completed":
        jsonschema.validate(json.loads(response.output_text), schema)


def test_the_store_keeps_the_most_recent_conversations() -> None:
    store = ResponseStore(bound=2)
    ids = [new_response_id() for _ in range(3)]
    for i, response_id in enumerate(ids):
        store.keep(response_id, [{"role": "user", "content": str(i)}])
        if i == 1:
            store.conversation(ids[0])  # a read makes it recent
    assert store.conversation(ids[0]) == [{"role": "user", "content": "0"}]
    with pytest.raises(ApiError) as caught:
        store.conversation(ids[1])
    assert caught.value.status == 404 and caught.value.param == "previous_response_id"


def test_input_items_become_chat_messages() -> None:
    messages = input_messages(
        [
            {"role": "developer", "content": [{"type": "input_text", "text": "be nice"}]},
            {"type": "message", "role": "user", "content": "hi"},
            {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"a": 1}'},
            {"type": "function_call_output", "call_id": "c1", "output": "one"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "done"}]},
        ]
    )
    assert messages == [
        {"role": "developer", "content": "be nice"},
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "hmm",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                {"id": "c2", "type": "function", "function": {"name": "g", "arguments": '{"a": 1}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "assistant", "content": "done"},
    ]


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-3, 3)
    | st.sampled_from(["", "x", "user", "message", "function_call"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(KEYS), inner, max_size=4),
    max_leaves=12,
)
FIELDS = st.fixed_dictionaries(
    {},
    optional={
        "input": JSON | st.lists(st.dictionaries(st.sampled_from(KEYS), JSON, max_size=5), max_size=3),
        "instructions": JSON,
        "previous_response_id": JSON | st.just("resp_" + "0" * 32),
        "tools": JSON,
        "tool_choice": JSON,
        "text": JSON,
        "reasoning": JSON,
        "store": JSON,
        "stream": st.booleans(),
    },
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fields=FIELDS)
def test_malformed_bodies_are_4xx_never_500(server: LiveServer, fields: dict[str, Any]) -> None:
    body = {"model": MODEL_NAME, "input": "hi", "max_output_tokens": 1, **fields}
    reply = httpx.post(server.url + "/v1/responses", json=body, timeout=TIMEOUT)
    assert reply.status_code in (200, 400, 404), (body, reply.text)
    event(f"status {reply.status_code}")
    if reply.status_code != 200:
        error = reply.json()["error"]
        assert error["param"], (body, error)


@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_failure_fails_the_response_and_stores_nothing(
    server: LiveServer, client: Any, monkeypatch: Any, stream: bool
) -> None:
    runner = server.manager.engine.runner
    real_run, calls = runner.run, []

    def fail_once(batch: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected kernel failure")
        return real_run(batch)

    monkeypatch.setattr(runner, "run", fail_once)
    stored = len(server.state.stored.conversations)
    kwargs = {"model": MODEL_NAME, "input": "x", "max_output_tokens": 4}
    if stream:
        events = list(client.responses.create(stream=True, **kwargs))
        assert [e.type for e in events[-2:]] == ["error", "response.failed"]
        assert "injected kernel failure" in events[-2].message
        assert events[-1].response.status == "failed" and events[-1].response.error.code == "server_error"
    else:
        with pytest.raises(openai.InternalServerError, match="injected kernel failure"):
            client.responses.create(**kwargs)
    assert len(server.state.stored.conversations) == stored
    monkeypatch.undo()
    assert client.responses.create(**kwargs).status in ("completed", "incomplete")
