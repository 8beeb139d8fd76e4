"""`make serve`'s model: the real one (SmolLM2-135M-Instruct) chats in English through the OpenAI client, and a
JSON-schema `response_format` gives valid JSON. Skipped, with the reason, when the model cannot be fetched."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.serve import MODEL_NAME, live_server, openai_client, requires_serve
from transformers_cb.models.fetch import FetchError, fetch_model
from transformers_cb.models.registry_model import SMOLLM2

pytestmark = [pytest.mark.real_model, requires_serve]

CAT = {
    "type": "object",
    "properties": {"breed": {"type": "string"}, "origin": {"type": "string"}},
    "required": ["breed", "origin"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def client() -> Iterator[Any]:
    from transformers_cb.models.loading import load_model_and_tokenizer

    try:
        folder = fetch_model(SMOLLM2, progress=False)
    except FetchError as error:
        pytest.skip(f"the real model is not available: {error}")
    model, tokenizer = load_model_and_tokenizer(str(folder), attn_implementation="paged|sdpa")
    with live_server(model, tokenizer, num_blocks=32) as live:
        yield openai_client(live)


def test_chat_answers_in_english(client: Any) -> None:
    reply = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Name a cat breed."}],
        max_tokens=16,
        temperature=0,
    )
    text = reply.choices[0].message.content
    words = text.lower().replace(",", " ").replace(".", " ").split()
    assert "cat" in words and "breed" in words, text  # "The most popular and beloved cat breed is ..."
    assert text.isascii(), text


def test_a_json_schema_response_format_gives_valid_json(client: Any) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("llguidance", reason="guided decoding needs the 'structured' extra")
    reply = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Name a cat breed and its country of origin, as JSON."}],
        max_tokens=48,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "cat", "schema": CAT}},
    )
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), CAT)


def test_the_openai_clients_tool_loop_on_the_real_model(client: Any) -> None:
    """A named tool call is schema-valid by construction; the `tool` turn renders through the model's own
    template (ChatML), and the answer after it is English text."""
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("llguidance", reason="forced tool calls need the 'structured' extra")
    parameters = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    }
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": parameters}}]
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=24,
        temperature=0,
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), parameters)
    messages += [choice.message, {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 degrees."}]
    answer = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, tools=tools, max_tokens=24, temperature=0
    ).choices[0]
    assert answer.message.content and answer.message.content.isascii(), answer


def test_the_responses_api_answers_in_english_streamed_and_not(client: Any) -> None:
    kwargs: dict[str, Any] = {
        "model": MODEL_NAME,
        "instructions": "You are a helpful assistant.",
        "input": "Name a cat breed.",
        "max_output_tokens": 16,
        "temperature": 0,
    }
    whole = client.responses.create(**kwargs)
    words = whole.output_text.lower().replace(",", " ").replace(".", " ").split()
    assert "cat" in words or "breed" in words, whole.output_text
    events = list(client.responses.create(stream=True, **kwargs))
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == events[-1].response.output_text == whole.output_text
    follow = client.responses.create(
        model=MODEL_NAME,
        previous_response_id=whole.id,
        input="Another one?",
        max_output_tokens=8,
        temperature=0,
    )
    assert follow.usage.input_tokens > whole.usage.input_tokens + whole.usage.output_tokens
