"""`transformers-cb serve` end to end: the real command in a subprocess on 127.0.0.1, a free port,
talked to with the official `openai` client; answers compared with `generate_batch` (greedy)."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support.paths import REPO_ROOT
from tests.support.serve import CHAT_TEMPLATE, greedy_config, openai_client, requires_serve, served_text
from tests.support.threads import TIMEOUT
from tests.support.timeouts import hang_guard
from transformers_cb.cli.main import EXIT_BAD_INPUT, main

CACHE_ARGS = [
    "--model",
    "tiny",
    "--page-size",
    "16",
    "--num-blocks",
    "128",
    "--device",
    "cpu",
    "--log-level",
    "warning",
]
PROMPTS = ["Hello world", "The capital of France is", "Streaming text, one token at a time: é, 日本, 🙂"]


@dataclass
class ServerProcess:
    process: subprocess.Popen
    url: str
    lines: queue.Queue

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.process.wait(timeout=TIMEOUT)


def start_server(args: list[str]) -> ServerProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "transformers_cb.cli.main", "serve", "--port", "0", *CACHE_ARGS, *args]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO_ROOT
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stdout], daemon=True).start()
    seen = []
    while True:
        try:
            line = lines.get(timeout=hang_guard(180))
        except queue.Empty:
            process.kill()
            raise AssertionError(f"the server did not announce itself; output: {''.join(seen)}") from None
        seen.append(line)
        if line.startswith("transformers-cb serve: ") and " on http://" in line:
            return ServerProcess(process, line.rsplit(" on ", 1)[1].strip(), lines)
        if process.poll() is not None:
            raise AssertionError(f"the server exited with {process.returncode}: {''.join(seen)}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers_cb.models.tiny import build_tiny_model, build_tiny_tokenizer

    path = tmp_path_factory.mktemp("tiny-chat")
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    build_tiny_model(seed=0, tokenizer=tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[ServerProcess]:
    pytest.importorskip("openai", reason="the official openai client is in the test extra")
    live = start_server(["--model", str(model_dir), "--served-model-name", "tiny-chat"])
    try:
        yield live
    finally:
        assert live.stop() == 0


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Any:
    """`generate_batch` on the same checkpoint: (token ids, logprobs) per prompt."""
    from transformers_cb import ContinuousBatchingConfig
    from transformers_cb.models.loading import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(str(model_dir), attn_implementation="paged|sdpa")

    def generate(prompts: list[list[int]], max_new_tokens: int) -> list[tuple[list[int], list[float]]]:
        config = ContinuousBatchingConfig(page_size=16, num_blocks=128, return_logprobs=True)
        outputs = model.generate_batch(
            prompts,
            generation_config=greedy_config(tokenizer),
            continuous_batching_config=config,
            max_new_tokens=max_new_tokens,
            progress_bar=False,
        )
        return [
            (outputs[f"req_{i}"].generated_tokens, outputs[f"req_{i}"].logprobs) for i in range(len(prompts))
        ]

    return generate, tokenizer


def _client(live: ServerProcess) -> Any:
    return openai_client(live)


def _finish(tokens: list[int], tokenizer: Any, max_tokens: int) -> str:
    return "stop" if tokens and tokens[-1] == tokenizer.eos_token_id else "length"


@requires_serve
@pytest.mark.slow  # the server in a subprocess
def test_models_and_health(server: ServerProcess) -> None:
    assert [m.id for m in _client(server).models.list().data] == ["tiny-chat"]
    import httpx

    assert httpx.get(server.url + "/health", timeout=TIMEOUT).json() == {"status": "ok"}


@requires_serve
@pytest.mark.slow  # the server in a subprocess
def test_completions_equal_generate_batch(server: ServerProcess, reference: Any) -> None:
    generate, tokenizer = reference
    max_tokens = 24
    expected = generate([tokenizer.encode(p) for p in PROMPTS], max_tokens)
    client = _client(server)
    for prompt, (tokens, logprobs) in zip(PROMPTS, expected, strict=True):
        completion = client.completions.create(
            model="tiny-chat", prompt=prompt, max_tokens=max_tokens, logprobs=0, temperature=0
        )
        choice = completion.choices[0]
        assert choice.text == served_text(tokenizer, tokens)
        assert choice.finish_reason == _finish(tokens, tokenizer, max_tokens)
        assert completion.usage.prompt_tokens == len(tokenizer.encode(prompt))
        assert completion.usage.completion_tokens == len(tokens)
        assert choice.logprobs.token_logprobs == pytest.approx(logprobs, abs=1e-4)
        # Streaming gives the same text, in pieces, and the same usage.
        stream = client.completions.create(
            model="tiny-chat",
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
        assert chunks[-1].usage.completion_tokens == len(tokens)


@requires_serve
@pytest.mark.slow  # the server in a subprocess
def test_prompt_as_token_ids(server: ServerProcess, reference: Any) -> None:
    generate, tokenizer = reference
    ids = tokenizer.encode(PROMPTS[1])
    [(tokens, _)] = generate([ids], 10)
    completion = _client(server).completions.create(
        model="tiny-chat", prompt=ids, max_tokens=10, temperature=0
    )
    assert completion.choices[0].text == served_text(tokenizer, tokens)
    assert completion.usage.completion_tokens == len(tokens)


@requires_serve
@pytest.mark.slow  # the server in a subprocess
def test_chat_completions_equal_generate_batch(server: ServerProcess, reference: Any) -> None:
    generate, tokenizer = reference
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there, é?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = tokenizer.encode(text, add_special_tokens=False)
    [(tokens, logprobs)] = generate([prompt], 20)
    client = _client(server)
    chat = client.chat.completions.create(
        model="tiny-chat", messages=messages, max_tokens=20, logprobs=True, temperature=0
    )
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == served_text(tokenizer, tokens)
    assert [t.logprob for t in chat.choices[0].logprobs.content] == pytest.approx(logprobs, abs=1e-4)
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (len(prompt), len(tokens))
    stream = client.chat.completions.create(
        model="tiny-chat", messages=messages, max_tokens=20, stream=True, temperature=0
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == chat.choices[0].finish_reason


@requires_serve
@pytest.mark.slow  # the server in a subprocess
def test_n_choices(server: ServerProcess, reference: Any) -> None:
    generate, tokenizer = reference
    [(tokens, _)] = generate([tokenizer.encode(PROMPTS[0])], 8)
    client = _client(server)
    completion = client.completions.create(
        model="tiny-chat", prompt=PROMPTS[0], max_tokens=8, n=2, temperature=0
    )
    assert [c.index for c in completion.choices] == [0, 1]
    expected = served_text(tokenizer, tokens)
    assert [c.text for c in completion.choices] == [expected, expected]  # greedy: identical choices
    assert completion.usage.completion_tokens == 2 * len(tokens)
    texts = {0: "", 1: ""}
    for chunk in client.completions.create(
        model="tiny-chat", prompt=PROMPTS[0], max_tokens=8, n=2, stream=True, temperature=0
    ):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == {0: expected, 1: expected}


@requires_serve
@pytest.mark.slow  # the server in a subprocess
def test_stop_string_cuts_the_text_and_counts_tokens_exactly(server: ServerProcess, reference: Any) -> None:
    generate, tokenizer = reference
    [(tokens, _)] = generate([tokenizer.encode(PROMPTS[1])], 32)
    full = served_text(tokenizer, tokens)
    start = next(
        i for i in range(2, len(full) - 1) if full[i : i + 2].isascii() and full[i : i + 2].isprintable()
    )
    stop = full[start : start + 2]
    cut = full.find(stop)
    # The stop completes with the first token whose text contains it.
    used = next(
        k for k in range(1, len(tokens) + 1) if stop in tokenizer.decode(tokens[:k], skip_special_tokens=True)
    )
    client = _client(server)
    completion = client.completions.create(
        model="tiny-chat", prompt=PROMPTS[1], max_tokens=32, stop=[stop, "\x00\x01"], temperature=0
    )
    assert completion.choices[0].text == full[:cut]
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage.completion_tokens == used
    streamed = client.completions.create(
        model="tiny-chat", prompt=PROMPTS[1], max_tokens=32, stop=stop, stream=True, temperature=0
    )
    chunks = [c for c in streamed if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == full[:cut]
    assert chunks[-1].choices[0].finish_reason == "stop"


@requires_serve
@pytest.mark.slow  # the server in a subprocess
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_drains_in_flight_streams_then_exits_cleanly(sig: int) -> None:
    # --model tiny (CACHE_ARGS): the built-in random model, served under its default name; it chats out of the box.
    import httpx

    live = start_server([])
    try:
        chat = httpx.post(
            live.url + "/v1/chat/completions",
            json={
                "model": "transformers-cb-tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4,
            },
            timeout=TIMEOUT,
        )
        assert chat.status_code == 200, chat.text
        assert chat.json()["choices"][0]["message"]["role"] == "assistant"
        body = {"model": "transformers-cb-tiny", "prompt": "drain me", "max_tokens": 200, "stream": True}
        with (
            httpx.Client(timeout=TIMEOUT) as client,
            client.stream("POST", live.url + "/v1/completions", json=body) as r,
        ):
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            live.process.send_signal(sig)  # mid-stream
            rest = [line for line in lines if line.startswith("data:")]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][5:])["choices"][0]["finish_reason"] in ("length", "stop")
        assert live.process.wait(timeout=TIMEOUT) == 0
        with pytest.raises(httpx.TransportError):
            httpx.get(live.url + "/health", timeout=5)
    finally:
        if live.process.poll() is None:
            live.process.kill()


def test_serve_without_the_extra_says_how_to_install(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    import transformers_cb.serve as serve

    monkeypatch.setattr(
        serve.importlib.util, "find_spec", lambda name: None if name == "uvicorn" else object()
    )
    assert main(["serve", "--port", "0"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "uvicorn" in err and "transformers-cb[serve]" in err
