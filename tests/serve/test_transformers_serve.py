"""`transformers serve --continuous-batching` on the plugin, driven by the `openai` client.

transformers' own server is the real client of the manager's contract (handlers registered before
`add_request`, delivery on the event loop, `background_thread_status`, its config class). A launcher
(tests/support/serve_launcher.py) imports `transformers_cb` and then runs transformers' CLI entry point in a
subprocess on 127.0.0.1. Chat and completion, streaming and not, 8 concurrent requests each: all
succeed and the greedy texts equal `generate()`'s. The latency comparison with transformers' built-in
continuous batching is a benchmark, not a timed test: `python benchmarks/transformers_serve_latency.py`.

The tiny model's tokenizer is word-level ("w0".."w251"), so text equality is token equality.
Skipped, with the reason, when the `serve` extra (`pip install -e ".[serve]"`) is not installed.
"""

from __future__ import annotations

import importlib.util
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.reference import greedy_reference
from tests.support.transformers_serve import (
    MAX_TOKENS,
    MODES,
    PROMPTS,
    Server,
    build_model_dir,
    run_concurrently,
    start_server,
)

SERVE_MODULES = ("fastapi", "uvicorn", "starlette", "pydantic", "openai", "rich")
_missing = [name for name in SERVE_MODULES if importlib.util.find_spec(name) is None]
pytestmark = [
    pytest.mark.skipif(
        bool(_missing),
        reason=f"the serve extra is not installed (pip install -e '.[serve]'): missing {', '.join(_missing)}",
    ),
    pytest.mark.slow,  # transformers serve in a subprocess
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("serve_model"))


@pytest.fixture(scope="module")
def expected(model_dir: Path) -> dict[tuple[str, int], str]:
    """Greedy `generate()` text per (mode, prompt index), on the input ids the server builds."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").eval()
    texts = {}
    for i, prompt in enumerate(PROMPTS):
        chat = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        for mode, ids in (("chat", chat), ("completion", tokenizer(prompt)["input_ids"])):
            tokens = greedy_reference(model, ids, MAX_TOKENS)  # the model's own eos (2) stops it
            texts[(mode, i)] = tokenizer.decode(tokens, skip_special_tokens=True)
    return texts


@pytest.fixture
def server(model_dir: Path, tmp_path: Path) -> Iterator[Server]:
    server = start_server(model_dir, tmp_path / "serve.log")
    yield server
    server.stop()


def test_transformers_serve_on_the_plugin_matches_generate(server: Server, expected) -> None:
    for mode, stream in MODES:
        results = run_concurrently(server, mode, stream)
        for i, (text, _) in enumerate(results):
            assert text == expected[(mode, i)], (
                f"{mode} stream={stream} prompt {i}: served {text!r}, generate() {expected[(mode, i)]!r}\n"
                f"{server.log()}"
            )
    log = server.log(tail=0)
    assert "transformers_cb plugin installed: True" in log, "the plugin did not serve"
    assert "Traceback" not in log and " 500 " not in log, log[-6000:]
    with urllib.request.urlopen(f"{server.url}/health", timeout=5) as response:
        assert response.status == 200
