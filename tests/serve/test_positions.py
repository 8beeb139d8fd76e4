"""The server's length limit follows the engine's rule (memory/sizing.py's `native_positions`): a model
whose rotary embedding runs past `max_position_embeddings` as `generate()` does (dynamic NTK, LongRoPE)
serves prompts past it; a position-only rope type stays limited to it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from tests.support.serve import MODEL_NAME, live_server
from transformers_cb.models.tiny import build_tiny_tokenizer
from transformers_cb.serve.server import serving_positions

httpx = pytest.importorskip("httpx", reason="httpx is in the test extra")

NATIVE = 32  # max_position_embeddings of the tiny models below


def _model(rope_parameters: dict[str, Any] | None) -> tuple[Any, Any]:
    tokenizer = build_tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=NATIVE,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **({"rope_parameters": rope_parameters} if rope_parameters else {}),
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval(), tokenizer


DYNAMIC = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}


def test_serving_positions_is_the_engines_rule() -> None:
    assert serving_positions(_model(None)[0]) == NATIVE
    assert serving_positions(_model(DYNAMIC)[0]) > 2**30


def _long_prompt(tokenizer: Any) -> list[int]:
    ordinary = [t for t in range(len(tokenizer)) if t not in tokenizer.all_special_ids]
    return [ordinary[(7 * i) % len(ordinary)] for i in range(NATIVE + 8)]


def test_a_prompt_past_max_position_embeddings_is_served_where_the_rope_runs_past_it() -> None:
    model, tokenizer = _model(DYNAMIC)
    prompt = _long_prompt(tokenizer)
    # The reference: a fresh model's generate() (dynamic NTK's rotary is stateful).
    fresh, _ = _model(DYNAMIC)
    greedy = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=None)
    expected = fresh.generate(torch.tensor([prompt]), generation_config=greedy)[0, len(prompt) :].tolist()
    with live_server(model, tokenizer) as live:
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        response = httpx.post(live.url + "/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 4
        assert response.json()["choices"][0]["text"] == tokenizer.decode(expected, skip_special_tokens=True)
        chat = {"model": MODEL_NAME, "input": "word " * (NATIVE + 8), "max_output_tokens": 2}
        responded = httpx.post(live.url + "/v1/responses", json=chat, timeout=60)
        assert responded.status_code == 200, responded.text


def test_a_position_only_rope_stays_limited_to_max_position_embeddings() -> None:
    model, tokenizer = _model(None)
    with live_server(model, tokenizer) as live:
        chat = {"model": MODEL_NAME, "input": "word " * (NATIVE + 8), "max_output_tokens": 2}
        refused = httpx.post(live.url + "/v1/responses", json=chat, timeout=60)
        assert refused.status_code == 400
        assert f"model's {NATIVE} positions" in refused.json()["error"]["message"]
