"""`transformers serve --continuous-batching` in a subprocess (through `serve_launcher.py`), a tiny model
with a word-level tokenizer saved for it, and concurrent requests through the `openai` client: what
tests/serve/test_transformers_serve.py and benchmarks/transformers_serve_latency.py share."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.support.models import tiny_llama
from tests.support.paths import REPO_ROOT, SERVE_LAUNCHER
from tests.support.timeouts import hang_guard

MAX_TOKENS = 16
CONCURRENCY = 8
STARTUP_TIMEOUT = hang_guard(240.0)
REQUEST_TIMEOUT = hang_guard(120.0)
PROMPTS = [" ".join(f"w{(7 * i + 3 * k) % 252}" for k in range(3 + 2 * i)) for i in range(CONCURRENCY)]
MODES = [("chat", False), ("chat", True), ("completion", False), ("completion", True)]


def build_model_dir(path: Path) -> Path:
    """A tiny random Llama and a word-level tokenizer with a chat template, saved for `serve` to load."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[BOS]": 1, "[EOS]": 2, "[UNK]": 3, **{f"w{i}": i + 4 for i in range(252)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="[BOS]", eos_token="[EOS]", pad_token="[PAD]", unk_token="[UNK]"
    )
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tiny_llama(None, vocab_size=256, bos_token_id=1, eos_token_id=2, pad_token_id=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """A `transformers serve` subprocess; `builtin=True` runs transformers' own continuous batching."""

    def __init__(self, model_dir: Path, log_path: Path, builtin: bool = False) -> None:
        self.model_dir, self.log_path = model_dir, log_path
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [sys.executable, str(SERVE_LAUNCHER), *(["--builtin"] if builtin else [])]
        args += ["serve", str(model_dir), "--continuous-batching", "--host", "127.0.0.1"]
        args += [
            "--port",
            str(self.port),
            "--device",
            "cpu",
            "--cb-num-blocks",
            "128",
            "--cb-block-size",
            "16",
        ]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            args, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT
        )

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"transformers serve exited with {self.process.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        pytest.fail(f"transformers serve did not become healthy in {STARTUP_TIMEOUT}s:\n{self.log()}")

    def log(self, tail: int = 6000) -> str:
        self._log.flush()
        text = self.log_path.read_text()
        return text[-tail:] if tail else text

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(30)
        self._log.close()


def start_server(model_dir: Path, log_path: Path, builtin: bool = False) -> Server:
    server = Server(model_dir, log_path, builtin)
    try:
        server.wait_ready()
    except BaseException:
        server.stop()
        raise
    return server


def request(client, model: str, mode: str, stream: bool, prompt: str) -> tuple[str, float]:
    """One request through the openai client: (text, seconds to its last byte)."""
    start = time.perf_counter()
    if mode == "chat":
        kwargs = {
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
        }
        if stream:
            chunks = client.chat.completions.create(model=model, stream=True, **kwargs)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            text = client.chat.completions.create(model=model, **kwargs).choices[0].message.content
    else:
        kwargs = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        if stream:
            chunks = client.completions.create(model=model, stream=True, **kwargs)
            text = "".join(c.choices[0].text or "" for c in chunks if c.choices)
        else:
            text = client.completions.create(model=model, **kwargs).choices[0].text
    return text, time.perf_counter() - start


def run_concurrently(server: Server, mode: str, stream: bool) -> list[tuple[str, float]]:
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=REQUEST_TIMEOUT, max_retries=0)
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        futures = [pool.submit(request, client, str(server.model_dir), mode, stream, p) for p in PROMPTS]
        return [future.result() for future in futures]
