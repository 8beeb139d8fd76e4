"""The server under load, cancellation and failure: a real uvicorn server in a thread on 127.0.0.1,
driven with raw HTTP (httpx) and the official `openai` client, with the manager in reach so its
`stats()` can be checked and its loop paused to make races deterministic."""

from __future__ import annotations

import asyncio
import contextlib
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
    shared_server,
    tiny_model_and_tokenizer,
    wait_until,
)
from tests.support.threads import TIMEOUT
from tests.support.timeouts import hang_guard
from transformers_cb.sampling.sampler import Samples

if MISSING:
    pytest.skip(requires_serve.kwargs["reason"], allow_module_level=True)
httpx = pytest.importorskip("httpx", reason="httpx is in the test extra")
openai = pytest.importorskip("openai", reason="the official openai client is in the test extra")


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with shared_server() as live:
        yield live


@pytest.fixture
def fresh() -> Any:
    """Build a server with its own model and config for one test."""

    def make(shutdown_timeout: float = 5.0, **config: Any) -> Any:
        model, tokenizer = tiny_model_and_tokenizer()
        return live_server(model, tokenizer, shutdown_timeout=shutdown_timeout, **config)

    return make


_client = openai_client


def _post(live: LiveServer, path: str, body: Any, **kwargs: Any) -> Any:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(live.url + path, content=content, timeout=TIMEOUT, **kwargs)


def _completion(prompt: Any = "Hello", **fields: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4, **fields}


def _assert_serving(live: LiveServer) -> None:
    assert httpx.get(live.url + "/health", timeout=TIMEOUT).json() == {"status": "ok"}
    assert _post(live, "/v1/completions", _completion()).status_code == 200


# -- point 5: bad input -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("path", "body", "status", "needle"),
    [
        ("/v1/completions", b"{not json", 400, "not valid JSON"),
        ("/v1/completions", b'"a string"', 400, "JSON object"),
        ("/v1/completions", _completion(max_tokens=-1), 400, "max_tokens"),
        ("/v1/completions", _completion(max_tokens="ten"), 400, "max_tokens"),
        ("/v1/completions", _completion(temperature="hot"), 400, "temperature"),
        ("/v1/completions", _completion(n="2"), 400, "n"),
        ("/v1/completions", _completion(stop=5), 400, "stop"),
        # Unknown fields are now ignored (tests/serve/test_clients.py); known ones out of range are not.
        ("/v1/completions", _completion(prompt=[1, 2, 10**6]), 400, "outside the vocabulary"),
        ("/v1/completions", _completion(logprobs=21), 400, "logprobs"),  # over MAX_TOP_LOGPROBS
        ("/v1/completions", _completion(presence_penalty=2.5), 400, "presence_penalty"),
        ("/v1/completions", _completion(logit_bias={"x": 1}), 400, "logit_bias"),
        ("/v1/completions", _completion(logit_bias={"5": 101}), 400, "logit_bias"),
        ("/v1/completions", _completion(min_tokens=-1), 400, "min_tokens"),
        ("/v1/completions", _completion(prompt_lookup_num_tokens=-1), 400, "prompt_lookup_num_tokens"),
        (
            "/v1/completions",
            _completion(speculative_config={"method": "eagle", "num_speculative_tokens": 3}),
            400,
            "speculative_config",
        ),
        ("/v1/completions", _completion(suffix="x"), 400, "suffix"),
        ("/v1/completions", _completion(best_of=3), 400, "best_of"),
        ("/v1/completions", _completion(prompt=["text", [1, 2]]), 400, "prompt"),
        ("/v1/completions", _completion(prompt=[[]]), 400, "empty prompt"),
        ("/v1/completions", _completion(stream_options={"include_usage": True}), 400, "stream_options"),
        ("/v1/completions", {**_completion(), "model": "gpt-4"}, 404, "gpt-4"),
        ("/v1/chat/completions", {"model": MODEL_NAME, "messages": "hi"}, 400, "messages"),
        (
            "/v1/chat/completions",
            {"model": MODEL_NAME, "messages": [{"role": "bot", "content": "x"}]},
            400,
            "role",
        ),
        (
            "/v1/chat/completions",
            {
                "model": MODEL_NAME,
                "messages": [{"role": "user", "content": "x"}],
                "logprobs": False,
                "top_logprobs": 2,
            },
            400,
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            {"model": "nope", "messages": [{"role": "user", "content": "x"}]},
            404,
            "nope",
        ),
        ("/v1/embeddings", _completion(), 404, "Not Found"),
    ],
)
def test_bad_input_gets_an_openai_error_and_the_server_keeps_serving(
    server: LiveServer, path: str, body: Any, status: int, needle: str
) -> None:
    response = _post(server, path, body)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert needle in error["message"]
    _assert_serving(server)


def test_unknown_model_with_the_official_client(server: LiveServer) -> None:
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        _client(server).completions.create(model="other", prompt="x", max_tokens=2)


def test_logprobs_zero_gives_one_logprob_per_token(server: LiveServer) -> None:
    completion = _client(server).completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=5, logprobs=0)
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.token_logprobs) == completion.usage.completion_tokens
    assert all(lp <= 0.0 for lp in logprobs.token_logprobs)


def test_neutral_sampling_values_are_greedy(server: LiveServer) -> None:
    greedy = _post(server, "/v1/completions", _completion(max_tokens=6, temperature=0)).json()
    neutral = _post(
        server,
        "/v1/completions",
        _completion(max_tokens=6, temperature=0, top_p=1.0, top_k=-1, presence_penalty=0, logit_bias={}),
    ).json()
    assert neutral["choices"][0]["text"] == greedy["choices"][0]["text"]


def test_batch_of_prompts_with_n_choices(server: LiveServer) -> None:
    body = _completion(prompt=["first prompt", "a second, longer prompt"], n=2, max_tokens=5, temperature=0)
    answer = _post(server, "/v1/completions", body).json()
    choices = answer["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    singles = [
        _post(server, "/v1/completions", _completion(prompt=p, max_tokens=5, temperature=0)).json()
        for p in body["prompt"]
    ]
    assert [c["text"] for c in choices] == [s["choices"][0]["text"] for s in singles for _ in range(2)]
    usage = answer["usage"]
    assert usage["prompt_tokens"] == sum(s["usage"]["prompt_tokens"] for s in singles)
    assert usage["completion_tokens"] == 2 * sum(s["usage"]["completion_tokens"] for s in singles)


# -- point 3: streaming text ----------------------------------------------------------------------
def test_streamed_text_never_splits_a_multibyte_character(fresh: Any, monkeypatch: Any) -> None:
    # Script the sampler to emit the UTF-8 bytes of `text` (one byte = one token of the tiny tokenizer),
    # so most characters span several tokens, then EOS.
    text = "né 日本 🙂!"
    with fresh() as live:
        tokenizer = live.state.tokenizer
        script = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]
        sampler = live.manager.engine.runner.sampler
        emitted: list[int] = []

        def scripted(logits: Any, requests: Any) -> Any:
            tokens = [script[min(len(emitted) + i, len(script) - 1)] for i in range(logits.shape[0])]
            emitted.extend(tokens)
            with_logprobs = any(
                r.sampling is not None and r.sampling.params.return_logprobs for r in requests
            )
            return Samples(tokens, [0.0] * len(tokens) if with_logprobs else None)

        monkeypatch.setattr(sampler, "sample", scripted)
        chunks = list(
            _client(live).completions.create(
                model=MODEL_NAME, prompt="x", max_tokens=len(script) + 5, stream=True
            )
        )
        pieces = [c.choices[0].text for c in chunks]
        assert "".join(pieces) == text
        assert all("\ufffd" not in piece for piece in pieces)
        assert len([p for p in pieces if p]) >= 5  # streamed as characters complete, not at the end
        assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_max_tokens_inside_a_character_leaves_no_replacement_char(
    fresh: Any, monkeypatch: Any, stream: bool
) -> None:
    # The emoji's 4 bytes are 4 tokens; max_tokens stops after 2 of them.
    with fresh() as live:
        tokenizer = live.state.tokenizer
        script = tokenizer.encode("ab🙂", add_special_tokens=False)
        sampler = live.manager.engine.runner.sampler
        emitted: list[int] = []

        def scripted(logits: Any, requests: Any) -> Any:
            tokens = [script[min(len(emitted) + i, len(script) - 1)] for i in range(logits.shape[0])]
            emitted.extend(tokens)
            return Samples(tokens, None)

        monkeypatch.setattr(sampler, "sample", scripted)
        client = _client(live)
        if stream:
            chunks = list(client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=4, stream=True))
            text = "".join(c.choices[0].text for c in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            answer = client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=4)
            text, finish = answer.choices[0].text, answer.choices[0].finish_reason
        assert text == "ab"
        assert finish == "length"


# -- point 4: cancellation and load ----------------------------------------------------------------
def test_stream_disconnect_cancels_the_request_and_frees_its_pages(server: LiveServer) -> None:
    manager = server.manager
    before = manager.stats()
    body = _completion(prompt="Tell me a long story", max_tokens=900, stream=True)
    with (
        httpx.Client(timeout=TIMEOUT) as client,
        client.stream("POST", server.url + "/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200
        lines = r.iter_lines()  # kept referenced: closing this iterator would close the connection
        first = next(line for line in lines if line.startswith("data:"))
        assert json.loads(first[5:])["choices"][0]["finish_reason"] is None
        with manager.pause():  # the request cannot finish on its own from here on
            assert manager.stats().running == 1
            r.close()  # the client goes away mid-stream
            wait_until(lambda: manager.stats().cancelled == before.cancelled + 1, "the request is cancelled")
            after = manager.stats()
            assert (after.running, after.queued, after.pages_in_use) == (0, 0, 0)
            assert after.finished == before.finished
    _assert_serving(server)


def test_non_stream_disconnect_cancels_the_request(server: LiveServer) -> None:
    manager = server.manager
    before = manager.stats()

    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            task = asyncio.ensure_future(
                client.post(server.url + "/v1/completions", json=_completion(max_tokens=50))
            )
            while manager.stats().queued == 0:
                await asyncio.sleep(0.01)
            task.cancel()  # closes the connection before any answer
            await asyncio.gather(task, return_exceptions=True)

    with manager.pause():  # the request waits in the queue until the client has gone
        asyncio.run(asyncio.wait_for(scenario(), 60))
        wait_until(lambda: manager.stats().cancelled == before.cancelled + 1, "the request is cancelled")
    assert manager.stats().finished == before.finished
    _assert_serving(server)


def test_shutdown_cancels_what_outlives_the_grace_period(fresh: Any) -> None:
    with fresh(shutdown_timeout=0.5) as live:
        manager = live.manager
        body = _completion(prompt="Tell me a long story", max_tokens=900, stream=True)
        with (
            httpx.Client(timeout=TIMEOUT) as client,
            client.stream("POST", live.url + "/v1/completions", json=body) as r,
        ):
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            with manager.pause():  # the request cannot finish within the grace period
                live.server.should_exit = True
                wait_until(lambda: manager.stats().cancelled == 1, "the in-flight request is cancelled")
                assert manager.stats().pages_in_use == 0
            rest = []
            with contextlib.suppress(httpx.HTTPError):  # the server closes the connection mid-body
                rest = list(lines)
            assert "data: [DONE]" not in rest


def test_full_queue_answers_429_and_the_queued_requests_still_complete(fresh: Any) -> None:
    with fresh(max_queue_size=2) as live:
        manager = live.manager

        async def scenario() -> list[Any]:
            async with httpx.AsyncClient(timeout=TIMEOUT) as client:
                with manager.pause():
                    tasks = [
                        asyncio.ensure_future(client.post(live.url + "/v1/completions", json=_completion()))
                        for _ in range(2)
                    ]
                    while manager.stats().queued < 2:
                        await asyncio.sleep(0.01)
                    refused = await client.post(live.url + "/v1/completions", json=_completion())
                    assert refused.status_code == 429
                    assert refused.json()["error"]["type"] == "rate_limit_error"
                    with pytest.raises(openai.RateLimitError):
                        await asyncio.to_thread(
                            _client(live).completions.create, model=MODEL_NAME, prompt="x", max_tokens=2
                        )
                return await asyncio.gather(*tasks)

        responses = asyncio.run(asyncio.wait_for(scenario(), 120))
        assert [r.status_code for r in responses] == [200, 200]
        assert manager.stats().finished == 2


def test_a_request_that_can_never_fit_is_400_with_the_engine_message(server: LiveServer) -> None:
    # 64 pages of 16 tokens: 1500 new tokens can never fit, whatever else runs.
    response = _post(server, "/v1/completions", _completion(max_tokens=1500))
    assert response.status_code == 400
    assert re.search(r"needs \d+ KV pages", response.json()["error"]["message"])
    too_long = _post(server, "/v1/completions", _completion(max_tokens=2100))
    assert too_long.status_code == 400
    assert "max_position_embeddings" in too_long.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_failure_fails_that_request_only(fresh: Any, monkeypatch: Any, stream: bool) -> None:
    with fresh() as live:
        runner = live.manager.engine.runner
        real_run = runner.run
        calls = []

        def fail_once(batch: Any) -> Any:
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("injected kernel failure")
            return real_run(batch)

        monkeypatch.setattr(runner, "run", fail_once)
        client = _client(live)
        with pytest.raises(openai.APIError, match="injected kernel failure") as info:
            if stream:
                for _ in client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=4, stream=True):
                    pass
            else:
                client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=4)
        if not stream:
            assert isinstance(info.value, openai.InternalServerError)
        assert live.manager.stats().failed == 1
        _assert_serving(live)


def test_a_dead_engine_thread_fails_in_flight_requests_and_refuses_new_ones(
    fresh: Any, monkeypatch: Any
) -> None:
    with fresh() as live:

        def die(*args: Any) -> Any:
            raise KeyboardInterrupt("simulated death of the manager thread")  # not an Exception: kills it

        monkeypatch.setattr(live.manager.engine, "step", die)
        response = _post(live, "/v1/completions", _completion())
        assert response.status_code == 500
        assert "manager thread died" in response.json()["error"]["message"]
        wait_until(lambda: not live.manager.is_running(), "the manager thread is gone")
        assert httpx.get(live.url + "/health", timeout=TIMEOUT).status_code == 503
        assert _post(live, "/v1/completions", _completion()).status_code == 503


def test_concurrent_streams_each_complete_exactly_once(server: LiveServer) -> None:
    num_clients, max_tokens = 64, 6
    before = server.manager.stats()

    async def one(client: Any, i: int) -> tuple[list[dict], int]:
        body = _completion(prompt=f"client {i}: " + "x" * (i % 7), max_tokens=max_tokens, stream=True)
        body["stream_options"] = {"include_usage": True}
        chunks, done = [], 0
        async with client.stream("POST", server.url + "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    done += 1
                elif line.startswith("data: "):
                    assert done == 0, "data after [DONE]"
                    chunks.append(json.loads(line[6:]))
        return chunks, done

    async def scenario() -> list[tuple[list[dict], int]]:
        limits = httpx.Limits(max_connections=num_clients)
        async with httpx.AsyncClient(timeout=hang_guard(300), limits=limits) as client:
            return await asyncio.gather(*(one(client, i) for i in range(num_clients)))

    results = asyncio.run(asyncio.wait_for(scenario(), 600))
    for chunks, done in results:
        assert done == 1
        finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        assert finishes[-1] in ("length", "stop") and all(f is None for f in finishes[:-1])
        usage = chunks[-1]["usage"]
        assert chunks[-1]["choices"] == [] and usage["completion_tokens"] <= max_tokens
        assert finishes[-1] == "stop" or usage["completion_tokens"] == max_tokens
    wait_until(lambda: server.manager.stats().pages_in_use == 0, "all pages are released")
    after = server.manager.stats()
    assert after.finished - before.finished == num_clients
    assert (after.failed, after.cancelled) == (before.failed, before.cancelled)


# -- metrics -----------------------------------------------------------------------------------------
def _samples(text: str) -> dict[str, float]:
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def test_metrics_follow_stats_and_count_latencies(server: LiveServer) -> None:
    for _ in range(2):
        assert _post(server, "/v1/completions", _completion(max_tokens=3)).status_code == 200
    response = httpx.get(server.url + "/metrics", timeout=TIMEOUT)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    samples = _samples(response.text)
    stats = server.manager.stats()
    assert samples["transformers_cb_kv_pages_total"] == stats.pages_total
    assert samples["transformers_cb_requests_finished_total"] == stats.finished
    assert samples["transformers_cb_recomputed_tokens_total"] == stats.recomputed_tokens
    assert samples["transformers_cb_swap_out_pages_total"] == stats.swap_out_pages
    assert samples["transformers_cb_swapped_out_requests"] == stats.swapped_out == 0
    assert samples["transformers_cb_draft_tokens_total"] == stats.draft_tokens
    assert samples["transformers_cb_accepted_draft_tokens_total"] == stats.accepted_draft_tokens
    assert samples["transformers_cb_speculation_acceptance_rate"] == stats.acceptance_rate
    assert samples["transformers_cb_time_to_first_token_seconds_count"] >= 2
    assert samples["transformers_cb_inter_token_latency_seconds_count"] >= 4
    assert samples['transformers_cb_http_responses_total{endpoint="/v1/completions",status="200"}'] >= 2


def test_a_server_with_a_draft_model_speculates_and_gives_plain_greedy_text(
    fresh: Any, server: LiveServer
) -> None:
    """`--assistant-model`: every request speculates with the draft model (the target itself here, so
    every draft is accepted) unless it sets `num_assistant_tokens=0`; vLLM's speculative_config method
    "draft_model" sets the draft length; the text equals the plain server's, greedy. A server without a
    draft model answers its fields with a 400."""
    body = _completion("Hello there, hello there", max_tokens=12, temperature=0)
    plain = _post(server, "/v1/completions", body).json()["choices"][0]["text"]
    model, tokenizer = tiny_model_and_tokenizer()
    with live_server(model, tokenizer, assistant_model=model) as live:
        for extra in (
            {},
            {"num_assistant_tokens": 0},
            {"speculative_config": {"method": "draft_model", "num_speculative_tokens": 3}},
        ):
            response = _post(live, "/v1/completions", {**body, **extra})
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"] == plain, extra
        stats = live.state.manager.stats()
        assert stats.draft_tokens > 0 and stats.accepted_draft_tokens == stats.draft_tokens, stats
    response = _post(server, "/v1/completions", {**body, "num_assistant_tokens": 3})
    assert response.status_code == 400 and "--assistant-model" in response.text
