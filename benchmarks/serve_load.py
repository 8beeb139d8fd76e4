"""Load test of `transformers-cb serve`: many concurrent streaming clients against the real server.

    python benchmarks/serve_load.py                          # 64 clients, built-in tiny model, 32 tokens each
    python benchmarks/serve_load.py --clients 128 --max-tokens 64 --model path/to/model
    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --model-name NAME   # an already running server

It starts `transformers-cb serve` in a subprocess on 127.0.0.1 (a free port) unless `--url` is given, fires
`--clients` streaming completions at once (each with `logprobs=0`, so every SSE chunk carries exactly one token),
checks that every request completes exactly once (one `[DONE]`, one final `finish_reason`, `usage` equal to
the tokens received), prints client-side TTFT / inter-token / end-to-end latency percentiles and throughput,
then stops the server with SIGTERM and checks it exits 0. It ends by itself: every wait is bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass
class ClientRun:
    start: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    tokens: int = 0
    done_markers: int = 0
    finish_reasons: list[str] = field(default_factory=list)
    usage_tokens: int | None = None
    error: str | None = None

    @property
    def complete_once(self) -> bool:
        return (
            self.error is None
            and self.done_markers == 1
            and len(self.finish_reasons) == 1
            and self.usage_tokens == self.tokens
        )


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    command = [
        sys.executable,
        "-m",
        "transformers_cb.cli.main",
        "serve",
        "--port",
        "0",
        "--log-level",
        "warning",
    ]
    if args.model:
        command += ["--model", args.model]
    command += [
        "--device",
        args.device,
        "--num-blocks",
        str(args.num_blocks),
        "--page-size",
        str(args.page_size),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stdout], daemon=True).start()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            if process.poll() is not None:
                break
            continue
        if line.startswith("transformers-cb serve: ") and " on http://" in line:
            return process, line.rsplit(" on ", 1)[1].strip()
    process.kill()
    raise SystemExit("the server did not start")


async def one_client(client: httpx.AsyncClient, url: str, body: dict, run: ClientRun) -> None:
    run.start = time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                run.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    run.done_markers += 1
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        run.error = chunk["error"]["message"]
                    elif chunk["choices"]:
                        choice = chunk["choices"][0]
                        run.chunk_times.append(time.perf_counter())
                        run.tokens += len(choice["logprobs"]["tokens"])
                        if choice["finish_reason"] is not None:
                            run.finish_reasons.append(choice["finish_reason"])
                    elif chunk.get("usage"):
                        run.usage_tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as error:
        run.error = f"{type(error).__name__}: {error}"


async def load(url: str, args: argparse.Namespace) -> tuple[list[ClientRun], float]:
    runs = [ClientRun() for _ in range(args.clients)]
    limits = httpx.Limits(max_connections=args.clients)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.wait_for(
            asyncio.gather(
                *(
                    one_client(
                        client,
                        url,
                        {
                            "model": args.model_name,
                            "prompt": prompt_text(i),
                            "max_tokens": args.max_tokens,
                            "temperature": args.temperature,
                            "stream": True,
                            "logprobs": 0,
                            "stream_options": {"include_usage": True},
                        },
                        run,
                    )
                    for i, run in enumerate(runs)
                )
            ),
            timeout=args.timeout,
        )
        return runs, time.perf_counter() - start


def prompt_text(i: int) -> str:
    return f"Request {i}: " + "lorem ipsum " * (i % 5)


def engine_reference(args: argparse.Namespace) -> float:
    """Generated tokens/s of `generate_batch` on the same prompts and model, no HTTP: the engine's own ceiling."""
    import torch
    from transformers import GenerationConfig

    from transformers_cb import ContinuousBatchingConfig
    from transformers_cb.models.loading import load_model_and_tokenizer

    torch.manual_seed(0)
    model, tokenizer = load_model_and_tokenizer(args.model, device=args.device)
    prompts = [tokenizer.encode(prompt_text(i)) for i in range(args.clients)]
    config = GenerationConfig(
        do_sample=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    cb_config = ContinuousBatchingConfig(
        page_size=args.page_size, num_blocks=args.num_blocks, return_logprobs=True
    )
    best = 0.0
    for _ in range(2):  # the first run pays one-time set-up
        start = time.perf_counter()
        outputs = model.generate_batch(
            prompts,
            generation_config=config,
            continuous_batching_config=cb_config,
            max_new_tokens=args.max_tokens,
            progress_bar=False,
        )
        tokens = sum(len(o.generated_tokens) for o in outputs.values())
        best = max(best, tokens / (time.perf_counter() - start))
    return best


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def report(runs: list[ClientRun], wall: float) -> int:
    ttft = [r.chunk_times[0] - r.start for r in runs if r.chunk_times]
    itl = [b - a for r in runs for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False)]
    e2e = [r.chunk_times[-1] - r.start for r in runs if r.chunk_times]
    tokens = sum(r.tokens for r in runs)
    ok = sum(r.complete_once for r in runs)
    print("| clients | completed exactly once | tokens | wall (s) | tokens/s |")
    print("|---|---|---|---|---|")
    print(f"| {len(runs)} | {ok} | {tokens} | {wall:.2f} | {tokens / wall:.1f} |")
    print()
    print("| latency (ms) | p50 | p90 | p99 | max |")
    print("|---|---|---|---|---|")
    for name, values in (("TTFT", ttft), ("inter-token", itl), ("end-to-end", e2e)):
        row = [percentile(values, q) * 1000 for q in (50, 90, 99, 100)]
        print(f"| {name} | " + " | ".join(f"{v:.1f}" for v in row) + " |")
    for run in runs:
        if not run.complete_once:
            print(f"NOT COMPLETED EXACTLY ONCE: {run}", file=sys.stderr)
    return 0 if ok == len(runs) else 1


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0: greedy (the default here); OpenAI's default is 1"
    )
    parser.add_argument("--model", default=None, help="local model directory (default: built-in tiny model)")
    parser.add_argument(
        "--model-name", default=None, help="served model name (default: derived like the server)"
    )
    parser.add_argument("--url", default=None, help="use this running server instead of starting one")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=512)
    parser.add_argument("--timeout", type=float, default=600.0, help="bound on the whole load phase (s)")
    parser.add_argument(
        "--engine-reference",
        action="store_true",
        help="after the load, run generate_batch on the same prompts in this process (no HTTP) for comparison",
    )
    args = parser.parse_args()
    if args.model_name is None:
        args.model_name = Path(args.model).name if args.model else "transformers-cb-tiny"
    process = None
    url = args.url
    if url is None:
        process, url = start_server(args)
    try:
        runs, wall = asyncio.run(load(url, args))
        status = report(runs, wall)
    finally:
        if process is not None:
            process.send_signal(signal.SIGTERM)
            code = process.wait(timeout=120)
            print(f"server exit status after SIGTERM: {code}")
            status = status if code == 0 else 1
    if args.engine_reference:
        print(
            f"generate_batch on the same prompts, no HTTP (best of 2): {engine_reference(args):.1f} tokens/s"
        )
    return status


if __name__ == "__main__":
    sys.exit(main())
