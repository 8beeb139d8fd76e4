"""Serving adapters (issue 50, docs/adapters.md): `--adapter name=path` folders loaded into the served
model, the request's `model` field picks one (the base model's id: no adapter), through the official
`openai` client, each answer equal to `generate()` after `set_adapter`; `/v1/models` lists the base model
and the adapters; an unknown model is a 404 with an OpenAI error body while the others are served;
`POST /v1/adapters` loads one more while serving."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.adapters import seed_lora_weights
from tests.support.serve import MISSING, MODEL_NAME, LiveServer, openai_client, requires_serve, serving
from tests.support.threads import TIMEOUT
from transformers_cb.conformance_check import reference_greedy

if MISSING:
    pytest.skip(requires_serve.kwargs["reason"], allow_module_level=True)
httpx = pytest.importorskip("httpx", reason="httpx is in the test extra")
openai = pytest.importorskip("openai", reason="the official openai client is in the test extra")
peft = pytest.importorskip("peft", reason="the adapter tests need peft (the test extra installs it)")

PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114]
MAX_TOKENS = 6
TARGETS = {"a": ["q_proj", "v_proj", "down_proj"], "b": ["k_proj", "o_proj", "up_proj"], "late": ["q_proj"]}


def _base() -> tuple[Any, Any]:
    from transformers_cb.models.loading import load_model_and_tokenizer

    return load_model_and_tokenizer(None, attn_implementation="paged|sdpa", seed=0)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each adapter saved alone, as PEFT saves one."""
    paths = {}
    for seed, (name, targets) in enumerate(TARGETS.items()):
        config = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=targets)
        model = peft.get_peft_model(_base()[0], config)
        seed_lora_weights(model, 2.0, seed=seed + 10)
        paths[name] = tmp_path_factory.mktemp(name)
        model.save_pretrained(paths[name])  # a PEFT adapter folder: its config and weights
    return paths


@pytest.fixture(scope="module")
def references(folders: dict[str, Path]) -> dict[str | None, tuple[list[str], list[float]]]:
    """Per adapter (None: the base model), `generate()`'s tokens as the server names them (each token's
    text) and their log-probabilities: the byte-level tokens' texts alone are ambiguous (U+FFFD), the two
    together are not."""
    from transformers import GenerationConfig

    model, tokenizer = _base()
    for name, path in folders.items():
        model.load_adapter(str(path), adapter_name=name)
    config = GenerationConfig(
        do_sample=False, max_new_tokens=MAX_TOKENS, eos_token_id=tokenizer.eos_token_id, pad_token_id=0
    )

    def expected() -> tuple[list[str], list[float]]:
        tokens = reference_greedy(model, PROMPT, config)
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1 : -1].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        return [tokenizer.decode([t]) for t in tokens], [float(logprobs[i, t]) for i, t in enumerate(tokens)]

    outcomes: dict[str | None, tuple[list[str], list[float]]] = {}
    for name in folders:
        model.set_adapter(name)
        outcomes[name] = expected()
    model.disable_adapters()
    outcomes[None] = expected()
    assert len({tuple(lp) for _, lp in outcomes.values()}) == len(outcomes), "the adapters change nothing"
    return outcomes


def _check(answer: Any, expected: tuple[list[str], list[float]], context: str) -> None:
    texts, logprobs = expected
    assert answer.choices[0].logprobs.tokens == texts, context
    assert answer.choices[0].logprobs.token_logprobs == pytest.approx(logprobs, abs=1e-4), context


@contextmanager
def _serving(folders: dict[str, Path], max_resident: int | None = None) -> Iterator[LiveServer]:
    from transformers_cb import ContinuousBatchingConfig
    from transformers_cb.serve.app import ServeState
    from transformers_cb.serve.served_adapters import ServedAdapters
    from transformers_cb.serve.server import serving_positions, start_serving_manager

    model, tokenizer = _base()
    served = ServedAdapters(MODEL_NAME, max_resident=max_resident)
    for name in ("a", "b"):  # as `--adapter a=... --adapter b=...` does, before the manager starts
        served.load(model, name, str(folders[name]))
    manager = start_serving_manager(model, tokenizer, ContinuousBatchingConfig(page_size=4, num_blocks=64))
    state = ServeState(manager, tokenizer, MODEL_NAME, serving_positions(model), served_adapters=served)

    def stop() -> None:
        manager.stop(block=True, timeout=TIMEOUT)
        manager.destroy()

    with serving(state, stop) as live:
        yield live


@pytest.fixture
def server(folders: dict[str, Path]) -> Iterator[LiveServer]:
    with _serving(folders) as live:
        yield live


def test_the_model_field_picks_the_adapter(server: LiveServer, references: dict, folders: dict) -> None:
    client = openai_client(server)
    ids = [card.id for card in client.models.list().data]
    assert ids == [MODEL_NAME, "a", "b"]
    for model, adapter in ((MODEL_NAME, None), ("a", "a"), ("b", "b"), ("a", "a")):
        answer = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, logprobs=0
        )
        _check(answer, references[adapter], model)
        assert answer.model == model
    with pytest.raises(openai.NotFoundError) as raised:
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    error = raised.value.body
    assert error["code"] == "model_not_found" and error["param"] == "model" and "nope" in error["message"]
    with pytest.raises(openai.NotFoundError):  # the chat endpoint too
        client.chat.completions.create(
            model="zzz", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    after = client.completions.create(
        model="b", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, logprobs=0
    )
    _check(after, references["b"], "b after the 404s")


def test_an_adapter_loaded_while_serving(server: LiveServer, references: dict, folders: dict) -> None:
    response = httpx.post(
        server.url + "/v1/adapters",
        content=json.dumps({"name": "late", "path": str(folders["late"])}),
        timeout=TIMEOUT,
    )
    assert response.status_code == 200, response.text
    assert [card["id"] for card in response.json()["data"]] == [MODEL_NAME, "a", "b", "late"]
    client = openai_client(server)
    answer = client.completions.create(
        model="late", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, logprobs=0
    )
    _check(answer, references["late"], "late, loaded while serving")
    again = httpx.post(
        server.url + "/v1/adapters",
        content=json.dumps({"name": "late", "path": str(folders["late"])}),
        timeout=TIMEOUT,
    )
    assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]


def test_one_resident_adapter_at_most_reloads_the_least_recently_used(
    folders: dict, references: dict
) -> None:
    with _serving(folders, max_resident=1) as live:
        manager = live.state.manager
        assert manager.adapters.names() == ["a"]  # b registered, loaded at its first request
        client = openai_client(live)
        assert [card.id for card in client.models.list().data] == [MODEL_NAME, "a", "b"]
        for model in ("b", "a", "b", MODEL_NAME):
            answer = client.completions.create(
                model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, logprobs=0
            )
            _check(answer, references[None if model == MODEL_NAME else model], f"{model}, one resident")
        assert manager.adapters.names() == ["b"]
        with manager.pause():  # a request on b stays live: b cannot be unloaded for a
            request_id = manager.add_request(PROMPT, adapter="b", max_new_tokens=MAX_TOKENS)
            response = httpx.post(
                live.url + "/v1/completions",
                content=json.dumps({"model": "a", "prompt": PROMPT, "max_tokens": 2}),
                timeout=TIMEOUT,
            )
            assert response.status_code == 503, response.text
            assert "resident adapters are in use" in response.json()["error"]["message"]
        assert manager.get_result(request_id=request_id, timeout=TIMEOUT) is not None
