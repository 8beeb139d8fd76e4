"""Single-stream latency side by side: `transformers-cb serve` and `transformers serve` (plain, and with its
built-in `--continuous-batching`).

    python benchmarks/serve_ttft.py                    # 40 requests per server, alternating
    python benchmarks/serve_ttft.py --requests 100 --max-tokens 32 --prompt-words 128

The servers load the same tiny model directory (tests/support/transformers_serve.py: a random Llama and
a word-level tokenizer), run at once on 127.0.0.1, and get the same synchronous workload (one streaming
completion at a time, temperature 0, what guidellm's synchronous profile sends), in alternating requests
so that a load change on the shared machine hits both alike. Prints time to first token (first chunk
with text) and inter-token latency (between text chunks), p50 / p99, per server.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from tests.support.paths import SERVE_LAUNCHER  # noqa: E402
from tests.support.transformers_serve import Server, build_model_dir  # noqa: E402


class PlainServer(Server):
    """`transformers serve` without continuous batching: one `generate()` per request."""

    def __init__(self, model_dir: Path, log_path: Path) -> None:
        self.model_dir, self.log_path = model_dir, log_path
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [
            sys.executable,
            str(SERVE_LAUNCHER),
            "--builtin",
            "serve",
            str(model_dir),
            "--host",
            "127.0.0.1",
        ]
        args += ["--port", str(self.port), "--device", "cpu"]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)


class OurServer:
    def __init__(self, model_dir: Path, log_path: Path, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.model = model_dir.name
        command = [sys.executable, "-m", "transformers_cb.cli.main", "serve", "--model", str(model_dir)]
        command += ["--port", str(port), "--device", "cpu", "--page-size", "16", "--num-blocks", "128"]
        command += ["--log-level", "warning"]
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"transformers-cb serve exited with {self.process.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.5)
        raise SystemExit("transformers-cb serve did not start")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(60)
        self._log.close()


def one_stream(client: httpx.Client, url: str, model: str, prompt: str, max_tokens: int) -> list[float]:
    """Seconds from sending to each chunk that carries text."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    start = time.perf_counter()
    times = []
    with client.stream("POST", url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                times.append(time.perf_counter() - start)
    return times


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))] if ordered else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=40, help="requests per server")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--prompt-words", type=int, default=64)
    parser.add_argument(
        "--byte-tokenizer",
        action="store_true",
        help="the built-in tiny model's byte-level tokenizer instead of the word-level one: random weights "
        "then often emit partial UTF-8 characters, which transformers-cb holds back (see docs/serve.md)",
    )
    args = parser.parse_args(argv)
    prompt = " ".join(f"w{(7 * k) % 252}" for k in range(args.prompt_words))
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        model_dir = tmp_path / "model"
        if args.byte_tokenizer:
            from transformers_cb.models.tiny import build_tiny_model, build_tiny_tokenizer

            tokenizer = build_tiny_tokenizer()
            build_tiny_model(seed=0, tokenizer=tokenizer).save_pretrained(model_dir)
            tokenizer.save_pretrained(model_dir)
        else:
            build_model_dir(model_dir)
        ours = OurServer(model_dir, tmp_path / "ours.log", port=_free_port())
        theirs = Server(model_dir, tmp_path / "builtin.log", builtin=True)
        plain = PlainServer(model_dir, tmp_path / "plain.log")
        servers = {
            "transformers-cb serve": (ours.url, ours.model),
            "transformers serve (built-in CB)": (theirs.url, str(model_dir)),
            "transformers serve (no CB)": (plain.url, str(model_dir)),
        }
        try:
            ours.wait_ready()
            theirs.wait_ready()
            plain.wait_ready()
            results: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in servers}
            with httpx.Client(timeout=120) as client:
                for url, model in servers.values():  # warm-up, not measured
                    one_stream(client, url, model, prompt, args.max_tokens)
                for _ in range(args.requests):
                    for name, (url, model) in servers.items():
                        times = one_stream(client, url, model, prompt, args.max_tokens)
                        if times:
                            results[name][0].append(times[0])
                            results[name][1].extend(b - a for a, b in zip(times, times[1:], strict=False))
        finally:
            ours.stop()
            theirs.stop()
            plain.stop()
    print(f"{args.requests} synchronous streaming completions per server, {args.prompt_words}-word prompt, "
          f"{args.max_tokens} tokens, alternating\n")  # fmt: skip
    print("| server | TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 (ms) | ITL p99 (ms) |")
    print("|---|---|---|---|---|")
    for name, (ttft, itl) in results.items():
        cells = [percentile(v, q) * 1000 for v in (ttft, itl) for q in (50, 99)]
        print(f"| {name} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")
    return 0


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


if __name__ == "__main__":
    sys.exit(main())
