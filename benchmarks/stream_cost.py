"""Does a long stream cost more per token at its end than at its start? One streamed completion of
`--tokens` tokens through the real server (the app on uvicorn in this process, the built-in tiny model),
timed per SSE chunk on the client, beside the engine's own per-token times for the same request.

    OMP_NUM_THREADS=1 python benchmarks/stream_cost.py                 # 2,000 tokens, 3 streams per variant
    OMP_NUM_THREADS=1 python benchmarks/stream_cost.py --tokens 1000 --repeats 1

It measures the checkout it is run from (the current directory goes first on `sys.path`), so the same
script times another tree: `cd ../other-tree && python path/to/benchmarks/stream_cost.py`.

Each stream is one `/v1/completions` request (`ignore_eos`, greedy, `max_tokens=--tokens`) read with httpx,
with `stream_options.continuous_usage_stats` so every chunk says how many tokens it has seen so far. The
variants: `plain` (text only: a chunk per completed character) and `logprobs` (`logprobs=1`: every token is
a chunk and carries its log-probabilities). Printed per variant: the mean time per token over the first
`--window` tokens and over the last `--window` tokens, and their ratio (1.0: no growth). `engine` is the
same request through `generate_batch(record_timestamps=True)`: the model's own growth with the context
(its attention reads a longer KV each step), which the server cannot avoid. Runs on a busy machine vary, so
the minimum over `--repeats` is printed beside the median.

`step work` times the streaming path without the model: a request's output after each new token
(`Request.to_output()`, what the manager publishes) turned into the server's event for the client
(`serve.events.choices.ManagerChoices.events`), per step at the start and at the end of `--tokens` tokens, with logprobs.
See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.getcwd())  # the checkout under test, not necessarily the one holding this file

import httpx  # noqa: E402

PROMPT = "Once upon a time"


def per_token_means(times: list[float], counts: list[int], window: int) -> tuple[float, float]:
    """Mean seconds per token over tokens (1, window] and (total - window, total], from the client's
    chunk arrival `times` and the cumulative token `counts` each chunk reported."""

    def arrival(k: int) -> float:  # when the k-th token had reached the client
        return next(t for t, c in zip(times, counts, strict=True) if c >= k)

    total = counts[-1]
    first = (arrival(window) - arrival(1)) / (window - 1)
    last = (arrival(total) - arrival(total - window)) / window
    return first, last


def stream_once(url: str, model: str, tokens: int, logprobs: bool) -> tuple[list[float], list[int]]:
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    if logprobs:
        body["logprobs"] = 1
    times: list[float] = []
    counts: list[int] = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            seen = chunk["usage"]["completion_tokens"]
            if chunk["choices"] and (not counts or seen > counts[-1]):
                times.append(time.perf_counter())
                counts.append(seen)
    if counts[-1] != tokens:
        raise AssertionError(f"the stream carried {counts[-1]} tokens, expected {tokens}")
    return times, counts


def engine_once(model: object, tokenizer: object, tokens: int) -> tuple[list[float], list[int]]:
    from transformers import GenerationConfig

    import transformers_cb

    ids = list(tokenizer.encode(PROMPT))
    out = model.generate_batch(
        [ids],
        GenerationConfig(do_sample=False),
        transformers_cb.ContinuousBatchingConfig(page_size=16, num_blocks=256),
        max_new_tokens=tokens,
        eos_token_id=[],  # ignore eos, as the server's ignore_eos
        record_timestamps=True,
        progress_bar=False,
    )
    stamps = next(iter(out.values())).timestamps
    return list(stamps), list(range(1, len(stamps) + 1))


def step_work(tokenizer: object, tokens: int) -> list[float]:
    """Seconds per streamed step (publish the output, turn it into a client event), step by step."""
    from transformers_cb.requests import Request, RequestStatus
    from transformers_cb.serve.events.choices import ChoiceOptions, ManagerChoices, Submitted
    from transformers_cb.serve.metrics import ServerMetrics

    request = Request("r", list(tokenizer.encode(PROMPT)), max_new_tokens=tokens, streaming=True)
    request.set_status(RequestStatus.DECODING)
    durations: list[float] = []

    async def outputs():  # the manager's side: one output per new token
        for k in range(tokens):
            request.append_token(65 + k % 26, -0.5, {65: -0.5})
            if k == tokens - 1:
                request.finish_reason = "length"
                request.set_status(RequestStatus.FINISHED)
            start = time.perf_counter()
            yield request.to_output()
            durations.append(time.perf_counter() - start)  # resumed once the event was made

    class Manager:  # what the choice's events may call at its end
        def cancel_request(self, request_id: str) -> None: ...

    options = ChoiceOptions(sampling={}, max_tokens=tokens, want_logprobs=True, top_logprobs=1)
    choice = Submitted("r", 0, outputs(), time.perf_counter())

    async def consume() -> None:
        async for _ in ManagerChoices(Manager()).events(choice, tokenizer, options, ServerMetrics()):  # type: ignore[arg-type]
            pass

    asyncio.run(consume())
    return durations


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--window", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import torch

    import transformers_cb
    from tests.support.serve import MODEL_NAME, live_server, tiny_model_and_tokenizer

    print(f"transformers_cb from {Path(transformers_cb.__file__).parent}", flush=True)
    print(
        f"torch threads {torch.get_num_threads()}, {args.tokens} tokens, windows of {args.window}", flush=True
    )
    model, tokenizer = tiny_model_and_tokenizer()
    rows: dict[str, list[tuple[float, float]]] = {"engine": [], "plain": [], "logprobs": []}
    with torch.inference_mode():
        for _ in range(args.repeats):
            rows["engine"].append(per_token_means(*engine_once(model, tokenizer, args.tokens), args.window))
    with live_server(model, tokenizer, num_blocks=256) as live:
        stream_once(live.url, MODEL_NAME, 32, False)  # warm the server's paths up
        for _ in range(args.repeats):
            for variant in ("plain", "logprobs"):
                times, counts = stream_once(live.url, MODEL_NAME, args.tokens, variant == "logprobs")
                rows[variant].append(per_token_means(times, counts, args.window))
    for _ in range(args.repeats):
        durations = step_work(tokenizer, args.tokens)
        first = statistics.fmean(durations[: args.window])
        last = statistics.fmean(durations[-args.window :])
        rows.setdefault("step work", []).append((first, last))
    print(
        f"{'path':<10} {'first ms/token':>15} {'last ms/token':>14} {'last / first':>13}   min of runs (median)"
    )
    for name, runs in rows.items():
        first, last = min(r[0] for r in runs) * 1e3, min(r[1] for r in runs) * 1e3
        median_first = statistics.median(r[0] for r in runs) * 1e3
        median_last = statistics.median(r[1] for r in runs) * 1e3
        print(
            f"{name:<10} {first:>15.4f} {last:>14.4f} {last / first:>13.2f}   "
            f"({median_first:.4f} {median_last:.4f} {median_last / median_first:.2f})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
