"""The OpenAI app on Ray Serve with 2 replicas (`scale_out/serve_app.py` `build_app`), on the session's
local cluster: the openai client gets, streamed and not, what one local process generates, and what the
local server on the same options answers (prompts rendered by jobs/prompts.py on both); `/metrics`
answers from the replica that served it."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.ray_jobs import on_the_ray_cluster, requires_ray
from tests.support.serve import CHAT_TEMPLATE, MODEL_NAME, requires_serve, serving
from tests.support.timeouts import hang_guard
from transformers_cb.jobs.prompts import chat_ids, text_ids
from transformers_cb.scale_out.predictor import CBPredictor
from transformers_cb.scale_out.serve_app import REPLICA_HEADER, build_app, serve_namespace

pytestmark = [requires_ray, requires_serve, pytest.mark.slow, on_the_ray_cluster]

SERVE_OPTIONS = {"page_size": 16, "num_blocks": 64, "seed": 0, "served_model_name": MODEL_NAME}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def serve_options(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The `transformers-cb serve` options of the replicas (and of the local server they are compared with)."""
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(CHAT_TEMPLATE, encoding="utf-8")
    return {**SERVE_OPTIONS, "model": str(model_dir), "chat_template": str(template)}


@pytest.fixture(scope="module")
def served(ray_cluster, serve_options: dict[str, Any]) -> Iterator[str]:
    from ray import serve

    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(
            build_app({**serve_options, "num_replicas": 2, "num_cpus": 0.5}), name="cb", route_prefix="/"
        )
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()


def _greedy_text(model_dir: Path, prompt_ids: list[int], max_new_tokens: int) -> str:
    predictor = CBPredictor(str(model_dir), continuous_batching_config={"page_size": 16})
    out = predictor({"prompt_token_ids": [prompt_ids], "max_new_tokens": [max_new_tokens]})
    return str(out["generated_text"][0])


def test_two_replicas_answer_the_openai_client(served: str, model_dir: Path) -> None:
    import openai
    from ray import serve

    status = serve.status().applications["cb"].deployments["transformers-cb"]
    assert status.replica_states.get("RUNNING") == 2

    client = openai.OpenAI(base_url=f"{served}/v1", api_key="unused", timeout=hang_guard(120), max_retries=0)
    predictor = CBPredictor(str(model_dir))
    for prompt in ("Hello there", "Ray Serve replicas"):
        expected = _greedy_text(model_dir, predictor.tokenizer.encode(prompt), 8)
        whole = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0)
        assert whole.choices[0].text == expected
        stream = client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0, stream=True
        )
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == expected

    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=6, temperature=0)
    streamed = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=6, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == chat.choices[0].message.content
    assert chat.usage.completion_tokens > 0


def test_metrics_come_from_the_replica_that_answered(served: str) -> None:
    import httpx

    replicas = set()
    for _ in range(8):
        response = httpx.get(f"{served}/metrics", timeout=hang_guard(60))
        assert response.status_code == 200
        assert "transformers_cb" in response.text
        replicas.add(response.headers[REPLICA_HEADER])
    assert replicas  # which of the 2 answers is Ray's choice; each names itself


CHATS = (
    [{"role": "user", "content": "line 0 of the input"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "line 1 of the input"}],
)


def test_the_replicas_answer_as_the_local_server(served: str, serve_options: dict[str, Any]) -> None:
    """`transformers-cb serve` in this process on the replicas' options (`build_state` of the same parsed
    namespace): every chat and completion gives the same tokens, over prompts of the same length."""
    import openai

    from transformers_cb.serve.server import build_state, drain

    state = build_state(serve_namespace({**serve_options, "threads": 1}))
    with serving(state, lambda: drain(state.manager, 5.0)) as live:
        clients = [
            openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=hang_guard(120), max_retries=0)
            for url in (served, live.url)
        ]
        for messages in CHATS:
            replies = [
                client.chat.completions.create(
                    model=MODEL_NAME, messages=messages, max_tokens=8, temperature=0, logprobs=True
                )
                for client in clients
            ]
            on_ray, local = ([t.token for t in r.choices[0].logprobs.content] for r in replies)
            assert on_ray == local and len(local) == 8
            assert replies[0].usage == replies[1].usage
            assert replies[0].usage.prompt_tokens == len(chat_ids(state.tokenizer, messages))
        completions = [
            client.completions.create(
                model=MODEL_NAME, prompt="line 2 of the input", max_tokens=8, temperature=0
            )
            for client in clients
        ]
        assert completions[0].choices[0].text == completions[1].choices[0].text
        assert completions[0].usage == completions[1].usage
        assert completions[0].usage.prompt_tokens == len(text_ids(state.tokenizer, "line 2 of the input"))
