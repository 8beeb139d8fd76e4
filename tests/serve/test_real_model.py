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
