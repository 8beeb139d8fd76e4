"""Structured outputs through the server: OpenAI's `response_format` on both endpoints and vLLM's `guided_*`
fields on completions, with the official `openai` client, streamed and not; refusals are 400s naming the field."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.serve import (
    MISSING,
    MODEL_NAME,
    LiveServer,
    live_server,
    openai_client,
    requires_serve,
    tiny_model_and_tokenizer,
)

if MISSING:
    pytest.skip(requires_serve.kwargs["reason"], allow_module_level=True)
openai = pytest.importorskip("openai", reason="the official openai client is in the test extra")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "population", "capital"],
    "additionalProperties": False,
}
JSON_SCHEMA_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "city", "schema": SCHEMA, "strict": True},
}
MAX_TOKENS = 120


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    model, tokenizer = tiny_model_and_tokenizer()
    with live_server(model, tokenizer) as live:
        yield live


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Any:
    return openai_client(server)


def _chat(client: Any, stream: bool, **kwargs: Any) -> tuple[str, str]:
    """(text, finish_reason) of one chat completion."""
    messages = [{"role": "user", "content": "Describe a city as JSON."}]
    if not stream:
        response = client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=MAX_TOKENS, **kwargs
        )
        return response.choices[0].message.content, response.choices[0].finish_reason
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=MAX_TOKENS, stream=True, **kwargs
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, [c.choices[0].finish_reason for c in chunks if c.choices][-1]


def _complete(client: Any, stream: bool, **kwargs: Any) -> tuple[str, str]:
    if not stream:
        response = client.completions.create(
            model=MODEL_NAME, prompt="Answer:", max_tokens=MAX_TOKENS, **kwargs
        )
        return response.choices[0].text, response.choices[0].finish_reason
    chunks = list(
        client.completions.create(
            model=MODEL_NAME, prompt="Answer:", max_tokens=MAX_TOKENS, stream=True, **kwargs
        )
    )
    return "".join(c.choices[0].text for c in chunks if c.choices), [
        c.choices[0].finish_reason for c in chunks
    ][-1]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_json_schema_response_format_returns_valid_json(client: Any, stream: bool) -> None:
    text, finish = _chat(client, stream, response_format=JSON_SCHEMA_FORMAT)
    assert finish == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completions_response_format_and_vllm_guided_fields(client: Any, stream: bool) -> None:
    text, finish = _complete(client, stream, extra_body={"response_format": JSON_SCHEMA_FORMAT})
    assert finish == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)
    text, _ = _complete(client, stream, extra_body={"guided_json": SCHEMA})
    jsonschema.validate(json.loads(text), SCHEMA)
    text, _ = _complete(client, stream, extra_body={"guided_regex": r"[0-9]{3}-[a-z]{2}"})
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", text), text
    text, finish = _complete(client, stream, extra_body={"guided_choice": ["positive", "negative"]})
    assert text in ("positive", "negative") and finish == "stop"
    text, _ = _complete(client, stream, extra_body={"guided_grammar": 'root ::= "(" [xy]+ ")"'})
    assert re.fullmatch(r"\([xy]+\)", text), text


def test_json_object_response_format(client: Any) -> None:
    text, finish = _chat(client, False, response_format={"type": "json_object"})
    # Any object: the random model's keys may run past max_tokens; what it wrote is an object's prefix.
    assert text.startswith("{") and (finish == "length" or isinstance(json.loads(text), dict))


def test_n_choices_each_follow_the_schema(client: Any) -> None:
    response = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Cities:"}],
        max_tokens=MAX_TOKENS,
        n=3,
        response_format=JSON_SCHEMA_FORMAT,
    )
    assert len(response.choices) == 3
    for choice in response.choices:
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"guided_regex": "a(b"}, "guided_regex", "unclosed group"),
        ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_regex", "one output constraint"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "needs json_schema"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "bogus"}},
                }
            },
            "response_format",
            "bogus",
        ),
    ],
)
def test_bad_constraints_are_400_naming_the_field(client: Any, body: dict, param: str, message: str) -> None:
    with pytest.raises(openai.BadRequestError, match=message) as info:
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=4, extra_body=body)
    assert info.value.body["param"] == param
    # ... and the server keeps serving
    text, _ = _complete(client, False, extra_body={"guided_choice": ["ok"]})
    assert text == "ok"


def test_without_the_structured_extra_it_is_a_400_naming_it(
    server: LiveServer, client: Any, monkeypatch: Any
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "llguidance", None)
    # As on a server that never loaded it: the engine's compiler has not met llguidance yet.
    monkeypatch.setattr(server.manager.engine.sampling.grammars, "_lltokenizer", None)
    with pytest.raises(openai.BadRequestError, match="structured") as info:
        client.completions.create(
            model=MODEL_NAME, prompt="x", max_tokens=4, extra_body={"guided_regex": "[a-z]+"}
        )
    assert info.value.body["param"] == "guided_regex"
