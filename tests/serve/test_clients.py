"""What real clients send, through the official `openai` client and raw HTTP against a live server set
up as `transformers-cb serve` sets it up: sampling on by default with reproducible seeds and `n`,
echo with prompt logprobs (what log-likelihood harnesses use), top logprobs, OpenAI's penalties and
logit_bias, min_tokens / stop_token_ids / ignore_eos, unknown fields, continuous usage stats.
lm-eval and guidellm themselves run in scripts/real_clients.py."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.support.serve import (
    MISSING,
    MODEL_NAME,
    LiveServer,
    openai_client,
    requires_serve,
    shared_server,
    tiny_model_and_tokenizer,
)
from tests.support.threads import TIMEOUT

if MISSING:
    pytest.skip(requires_serve.kwargs["reason"], allow_module_level=True)
httpx = pytest.importorskip("httpx", reason="httpx is in the test extra")
openai = pytest.importorskip("openai", reason="the official openai client is in the test extra")

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with shared_server() as live:
        yield live


@pytest.fixture(scope="module")
def reference() -> tuple[Any, Any]:
    """The same weights as the server's model, with plain sdpa attention, for direct forwards."""
    from transformers_cb.models.tiny import build_tiny_model, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    return build_tiny_model(seed=0, attn_implementation="sdpa", tokenizer=tokenizer), tokenizer


_client = openai_client


def _post(live: LiveServer, path: str, **body: Any) -> dict[str, Any]:
    response = httpx.post(live.url + path, json={"model": MODEL_NAME, **body}, timeout=TIMEOUT)
    assert response.status_code == 200, response.text
    return response.json()


def _complete(live: LiveServer, **fields: Any) -> Any:
    return _client(live).completions.create(model=MODEL_NAME, prompt=fields.pop("prompt", PROMPT), **fields)


# -- sampling and seeds ------------------------------------------------------------------------------
def test_seeded_sampling_reproduces_and_n_choices_differ(server: LiveServer) -> None:
    first = _complete(server, max_tokens=12, temperature=0.8, top_p=0.95, seed=7, n=3)
    again = _complete(server, max_tokens=12, temperature=0.8, top_p=0.95, seed=7, n=3)
    texts = [c.text for c in first.choices]
    assert texts == [c.text for c in again.choices]  # same seed, same choices
    assert len(set(texts)) == 3  # n seeded choices are distinct draws
    single = _complete(server, max_tokens=12, temperature=0.8, top_p=0.95, seed=7)
    assert single.choices[0].text == texts[0]
    other = _complete(server, max_tokens=12, temperature=0.8, top_p=0.95, seed=8)
    assert other.choices[0].text != texts[0]


def test_sampling_is_on_by_default_and_temperature_zero_is_greedy(server: LiveServer) -> None:
    greedy = {_complete(server, max_tokens=8, temperature=0).choices[0].text for _ in range(2)}
    assert len(greedy) == 1
    sampled = _complete(server, max_tokens=8, n=4, seed=1)  # no temperature: OpenAI's default of 1
    assert len({c.text for c in sampled.choices} | greedy) > 1


def test_chat_with_sampling_fields_reproduces_with_a_seed(server: LiveServer) -> None:
    def chat() -> Any:
        return _client(server).chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=6,
            temperature=0.7,
            top_p=0.9,
            seed=3,
            presence_penalty=0.5,
            frequency_penalty=0.5,
            n=2,
            extra_body={"top_k": 40, "min_p": 0.01, "repetition_penalty": 1.1},
        )

    first, again = chat(), chat()
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    assert 2 <= first.usage.completion_tokens <= 12


# -- logprobs --------------------------------------------------------------------------------------
def test_echo_gives_prompt_logprobs_of_a_plain_forward(server: LiveServer, reference: Any) -> None:
    model, tokenizer = reference
    ids = tokenizer.encode(PROMPT)
    with torch.no_grad():
        logprobs = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    expected = [logprobs[p - 1, ids[p]].item() for p in range(1, len(ids))]
    for max_tokens in (0, 3):
        completion = _complete(
            server, prompt=ids, max_tokens=max_tokens, echo=True, logprobs=2, temperature=0
        )
        choice = completion.choices[0]
        lp = choice.logprobs
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts token 0
        assert lp.token_logprobs[1 : len(ids)] == pytest.approx(expected, abs=1e-4)
        assert len(lp.tokens) == len(ids) + max_tokens
        assert completion.usage.completion_tokens == max_tokens
        checked = 0
        for p in range(1, len(ids)):
            best = logprobs[p - 1].topk(2)
            texts = [tokenizer.decode([t]) for t in [*best.indices.tolist(), ids[p]]]
            if len(set(texts)) < len(texts):
                continue  # byte tokens of partial characters share the text "\ufffd": keys collide
            top = lp.top_logprobs[p]
            # The k best, plus the prompt token itself (OpenAI's legacy format: up to k + 1).
            assert set(top) == set(texts) or set(top) == set(texts[:2])
            for text, value in zip(texts, best.values.tolist(), strict=False):
                assert top[text] == pytest.approx(value, abs=1e-4)
            checked += 1
        assert checked
        assert choice.text.startswith(tokenizer.decode(ids))  # token-id prompts echo as decoded


def test_max_tokens_zero_without_echo_is_an_empty_answer(server: LiveServer) -> None:
    completion = _complete(server, max_tokens=0)
    assert completion.choices[0].text == "" and completion.usage.completion_tokens == 0
    assert completion.choices[0].finish_reason == "length"


def test_top_logprobs_are_the_best_alternatives(server: LiveServer) -> None:
    completion = _complete(server, max_tokens=5, logprobs=3, temperature=0)
    lp = completion.choices[0].logprobs
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(top) <= 4  # k = 3 best and the chosen token, by text (equal texts merge)
        assert top[token] == pytest.approx(value) and value == pytest.approx(max(top.values()))  # greedy
    chat = _client(server).chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        logprobs=True,
        top_logprobs=5,
    )
    for entry in chat.choices[0].logprobs.content:
        values = [alt.logprob for alt in entry.top_logprobs]
        assert len(values) == 5 and values == sorted(values, reverse=True)
        assert entry.logprob <= values[0] + 1e-6


# -- processors and stops --------------------------------------------------------------------------
def test_logit_bias_stop_token_ids_ignore_eos_and_min_tokens(server: LiveServer, reference: Any) -> None:
    _, tokenizer = reference
    eos = tokenizer.eos_token_id
    forced = {str(eos): 100}
    assert _complete(server, max_tokens=6, temperature=0, logit_bias=forced).usage.completion_tokens == 1
    ignored = _post(
        server,
        "/v1/completions",
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        logit_bias=forced,
        ignore_eos=True,
    )
    assert ignored["usage"]["completion_tokens"] == 6 and ignored["choices"][0]["finish_reason"] == "length"
    held = _post(
        server, "/v1/completions", prompt=PROMPT, max_tokens=6, temperature=0, logit_bias=forced, min_tokens=3
    )
    assert held["usage"]["completion_tokens"] == 4 and held["choices"][0]["finish_reason"] == "stop"
    token = tokenizer.convert_tokens_to_ids("A")
    stopped = _post(
        server, "/v1/completions", prompt=PROMPT, max_tokens=6, temperature=0, logit_bias={str(token): 100},
        stop_token_ids=[token],
    )  # fmt: skip
    assert stopped["usage"]["completion_tokens"] == 1 and stopped["choices"][0]["finish_reason"] == "stop"


class _OpenAIPenalties:
    """OpenAI's documented formula, written independently as a transformers logits processor."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for row, ids in enumerate(input_ids):
            counts = torch.bincount(ids[self.prompt_len :], minlength=scores.shape[-1]).to(scores.dtype)
            scores[row] -= counts * self.frequency + (counts > 0).to(scores.dtype) * self.presence
        return scores


def test_presence_and_frequency_penalties_follow_openai(server: LiveServer) -> None:
    from transformers import GenerationConfig

    model, tokenizer = tiny_model_and_tokenizer()
    ids = tokenizer.encode(PROMPT)
    config = GenerationConfig(do_sample=False, eos_token_id=None, max_new_tokens=16)
    expected = model.generate_batch(
        [ids],
        generation_config=config,
        logits_processor=[_OpenAIPenalties(len(ids), 1.5, 0.7)],
        progress_bar=False,
    )["req_0"].generated_tokens
    plain = model.generate_batch([ids], generation_config=config, progress_bar=False)[
        "req_0"
    ].generated_tokens
    got = _post(
        server, "/v1/completions", prompt=ids, max_tokens=16, temperature=0, presence_penalty=1.5,
        frequency_penalty=0.7, ignore_eos=True,
    )  # fmt: skip
    assert expected != plain
    assert got["choices"][0]["text"] == tokenizer.decode(expected, skip_special_tokens=True)
    assert got["usage"]["completion_tokens"] == len(expected)


# -- fields and streaming --------------------------------------------------------------------------
def test_unknown_fields_are_ignored_with_a_warning(server: LiveServer, caplog: Any) -> None:
    with caplog.at_level(logging.WARNING, logger="transformers_cb.serve.protocol"):
        answer = _post(server, "/v1/completions", prompt=PROMPT, max_tokens=2, best_of_n_tricks=3, lora="x")
    assert answer["usage"]["completion_tokens"] == 2
    assert "best_of_n_tricks" in caplog.text and "lora" in caplog.text


def test_continuous_usage_stats_add_usage_to_every_chunk(server: LiveServer) -> None:
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 6, "stream": True, "logprobs": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=TIMEOUT) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert all(c["usage"] for c in chunks) and counts == sorted(counts)
    tokens = sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks if c["choices"])
    assert counts[-1] == tokens == 6 and not chunks[-1]["choices"]
