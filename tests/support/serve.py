"""Helpers for the server tests: skip without the `serve` extra, a real uvicorn server in a thread,
a tiny model with a chat template, and bounded waits."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest

from tests.support.threads import TIMEOUT
from transformers_cb.serve import INSTALL_HINT, missing_serve_modules

MISSING = missing_serve_modules()
requires_serve = pytest.mark.skipif(
    bool(MISSING), reason=f"the 'serve' extra is not installed ({', '.join(MISSING)}): {INSTALL_HINT}"
)

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
MODEL_NAME = "tiny-test"


def served_text(tokenizer: Any, tokens: list[int]) -> str:
    """The text the server sends for `tokens`: their decoding, less the U+FFFD of a character the last tokens
    leave incomplete (serve/events/text.py drops those bytes)."""
    return tokenizer.decode(tokens, skip_special_tokens=True).rstrip("\ufffd")


def wait_until(condition: Callable[[], bool], what: str, timeout: float = TIMEOUT) -> None:
    """Wait for an event that must happen (a liveness bound, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for: {what}")
        time.sleep(0.01)


def tiny_model_and_tokenizer(chat_template: bool = True) -> tuple[Any, Any]:
    from transformers_cb.models.loading import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(None, attn_implementation="paged|sdpa", seed=0)
    if chat_template:
        tokenizer.chat_template = CHAT_TEMPLATE
    return model, tokenizer


def greedy_config(tokenizer: Any) -> Any:
    from transformers import GenerationConfig

    return GenerationConfig(
        do_sample=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )


@dataclass
class LiveServer:
    url: str
    state: Any
    server: Any  # the uvicorn server: `server.should_exit = True` starts its graceful shutdown

    @property
    def manager(self) -> Any:
        return self.state.manager


def openai_client(live: LiveServer) -> Any:
    """The official `openai` client on `live` (no retries, the scaled hang guard as its timeout)."""
    import openai

    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)


def prompt_tokens(live: LiveServer, messages: list[dict], **kwargs: Any) -> int:
    """How many tokens `messages` take as the served tokenizer's chat template renders them (a prompt's usage)."""
    tokenizer = live.state.tokenizer
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
    return len(tokenizer.encode(text, add_special_tokens=False))


@contextmanager
def shared_server() -> Iterator[LiveServer]:
    """A live server on the built-in tiny model with the tests' chat template (one per test module)."""
    model, tokenizer = tiny_model_and_tokenizer()
    with live_server(model, tokenizer) as live:
        yield live


@contextmanager
def live_server(
    model: Any, tokenizer: Any, shutdown_timeout: float = 5.0, assistant_model: Any = None, **config: Any
) -> Iterator[LiveServer]:
    """A started manager on `model` (with `assistant_model`, `--assistant-model`), set up as
    `transformers-cb serve` sets it up, and the real app served by uvicorn on 127.0.0.1:<free port>."""
    from transformers_cb import ContinuousBatchingConfig
    from transformers_cb.serve.app import ServeState
    from transformers_cb.serve.server import serving_positions, start_serving_manager

    cb_config = ContinuousBatchingConfig(**{"page_size": 16, "num_blocks": 64, **config})
    manager = start_serving_manager(model, tokenizer, cb_config, assistant_model)
    state = ServeState(
        manager,
        tokenizer,
        MODEL_NAME,
        serving_positions(model),
        has_assistant=assistant_model is not None,
    )

    def stop() -> None:
        manager.stop(block=True, timeout=TIMEOUT)
        manager.destroy()

    with serving(state, stop, os.environ.get("TCB_LOG", "warning"), shutdown_timeout) as live:
        yield live


@contextmanager
def serving(
    state: Any, stop: Callable[[], None], log_level: str = "warning", shutdown_timeout: float = 5.0
) -> Iterator[LiveServer]:
    """`state`'s app served by uvicorn on 127.0.0.1:<free port> in a thread; on exit the server shuts
    down, then `stop()` ends `state`'s manager."""
    from transformers_cb.serve.app import build_openai_app
    from transformers_cb.serve.server import bind_socket, make_uvicorn_server

    sock = bind_socket("127.0.0.1", 0)
    server = make_uvicorn_server(
        build_openai_app(state), log_level=log_level, shutdown_timeout=shutdown_timeout
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        if not server.started_event.wait(60):
            raise AssertionError("the test server did not start")
        yield LiveServer(f"http://127.0.0.1:{sock.getsockname()[1]}", state, server)
    finally:
        server.should_exit = True
        thread.join(TIMEOUT)
        sock.close()
        stop()
