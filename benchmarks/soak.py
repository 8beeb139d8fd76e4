"""Soak test of `transformers-cb serve`: mixed traffic for a given time, then the server's books must balance.

    python benchmarks/soak.py --duration 120                         # CI (.ci/run): 2 minutes, the tiny model
    python benchmarks/soak.py --duration 3600 --model smollm2 --json /tmp/soak.json   # the documented hour

It starts `transformers-cb serve` in a subprocess (a small cache: `--num-blocks` pages of `--page-size`, so that
prompts at the cache's limit are cheap to make), and `--concurrency` clients send, for `--duration` seconds, a
mix drawn from a seeded generator: chat and completions, streaming and not, greedy and sampled (seeded, `n=2`),
structured outputs (`response_format` with a JSON schema), tool calls (`tool_choice` `required` and `auto`),
stop strings, logprobs, cancels (a whole answer the client stops waiting for), clients that disconnect
mid-stream, bad requests (each a known 4xx), and prompts at the cache's limit (one that fits exactly, one
token over: a 400). Every `--idle-every` seconds the clients pause until the server is idle.

It asserts, and exits 1 naming what failed otherwise:
- every request is answered exactly once (a stream: one `[DONE]`, one `finish_reason` per choice, no error
  event; a whole answer: every choice finished) or rejected with the 4xx its kind expects; no 5xx at all;
- whenever idle (each pause and the end): `/metrics` shows no queued or running request, no KV page and no
  state slot in use, and no failed request;
- resident memory flat after warm-up: no sample after `--warmup` seconds above the warm-up's peak by more
  than 5 %;
- the server exits 0 on SIGTERM.
It prints a summary table (and writes every figure to `--json`). Every wait is bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
RSS_TOLERANCE = 0.05
IDLE_TIMEOUT_S = 60.0
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 12}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
]
# kind: weight. Each kind's request and what counts as its correct answer are in `Traffic.send`.
MIX = {
    "chat_stream": 10,
    "chat_sampled": 6,
    "completion_stream_logprobs": 8,
    "completion_stop": 6,
    "structured": 4,
    "tool_required": 3,
    "tool_auto": 3,
    "cancel": 3,
    "disconnect": 4,
    "bad_request": 5,
    "limit_fits": 1,
    "limit_over": 2,
}
BAD_REQUESTS: list[tuple[str, Any, int]] = [
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400),
    ("/v1/chat/completions", {"messages": "not a list"}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": 7}, 400),
    ("/v1/completions", {"prompt": "hi", "model": "no-such-model"}, 404),
    ("/v1/completions", "{not json", 400),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"},
        400,
    ),
]


@dataclass
class Outcome:
    kind: str
    status: int | None = None
    ok: bool = False
    problem: str | None = None
    seconds: float = 0.0


@dataclass
class Books:
    outcomes: list[Outcome] = field(default_factory=list)
    idle_checks: list[dict[str, float]] = field(default_factory=list)
    rss: list[tuple[float, int]] = field(default_factory=list)  # (seconds since start, bytes)


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    command = [
        sys.executable,
        "-m",
        "transformers_cb.cli.main",
        "serve",
        "--model",
        args.model,
        "--port",
        "0",
    ]
    command += ["--device", "cpu", "--log-level", "warning", "--served-model-name", "soak"]
    command += ["--page-size", str(args.page_size), "--num-blocks", str(args.num_blocks), *args.serve_arg]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        for line in process.stdout or ():
            lines.put(line)
            if args.verbose:
                print("server:", line, end="", file=sys.stderr)

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + 600
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
    raise SystemExit("soak: the server did not start")


def rss_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    values = {}
    for line in text.splitlines():
        if line.startswith("transformers_cb_") and "{" not in line:
            name, _, value = line.partition(" ")
            values[name.removeprefix("transformers_cb_")] = float(value)
    return values


async def sse_lines(response: httpx.Response) -> AsyncIterator[str]:
    """The stream's lines as server-sent events define them: split at LF, CR LF or CR only. (httpx's
    `aiter_lines` also splits at U+2028, U+0085 and the like, which JSON may carry unescaped in a string.)"""
    pending = b""
    async for data in response.aiter_bytes():
        pending += data
        *lines, pending = pending.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
        for line in lines:
            yield line.decode("utf-8")
    if pending:
        yield pending.decode("utf-8")


class Traffic:
    """The clients: each request drawn from `MIX`, sent, and judged."""

    def __init__(self, url: str, args: argparse.Namespace, rng: random.Random) -> None:
        self.url = url
        self.args = args
        self.rng = rng
        self.cache_tokens = args.num_blocks * args.page_size

    def body(self, kind: str) -> tuple[str, Any, bool]:
        """(path, body, stream) of a request of `kind`."""
        rng = self.rng
        words = " ".join(
            rng.choice(["alpha", "beta", "gamma", "delta", "echo"]) for _ in range(rng.randint(2, 12))
        )
        messages = [{"role": "user", "content": f"Tell me about {words}."}]
        tokens = self.args.max_tokens
        chat = {"model": "soak", "messages": messages, "max_tokens": tokens}
        completion = {"model": "soak", "prompt": f"Once upon a time {words}", "max_tokens": tokens}
        if kind == "chat_stream":
            return "/v1/chat/completions", {**chat, "temperature": 0, "stream": True}, True
        if kind == "chat_sampled":
            return (
                "/v1/chat/completions",
                {**chat, "temperature": 0.8, "top_p": 0.9, "n": 2, "seed": rng.randint(0, 99)},
                False,
            )
        if kind == "completion_stream_logprobs":
            body = {**completion, "temperature": 0, "stream": True, "logprobs": 2}
            return "/v1/completions", {**body, "stream_options": {"include_usage": True}}, True
        if kind == "completion_stop":
            return "/v1/completions", {**completion, "temperature": 0, "stop": ["e", "\n"]}, False
        if kind == "structured":
            schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
            return (
                "/v1/chat/completions",
                {**chat, "temperature": 0, "response_format": schema, "max_tokens": 64},
                False,
            )
        if kind == "tool_required":
            stream = rng.random() < 0.5
            body = {**chat, "tools": TOOLS, "tool_choice": "required", "max_tokens": 64, "stream": stream}
            return "/v1/chat/completions", body, stream
        if kind == "tool_auto":
            return "/v1/chat/completions", {**chat, "tools": TOOLS, "temperature": 0}, False
        if kind == "cancel":
            return "/v1/completions", {**completion, "max_tokens": 4 * tokens, "temperature": 0}, False
        if kind == "disconnect":
            return (
                "/v1/completions",
                {**completion, "max_tokens": 4 * tokens, "temperature": 0, "stream": True},
                True,
            )
        if kind in ("limit_fits", "limit_over"):
            # A prompt whose KV (prompt + max_tokens - 1) fills the cache exactly, or exceeds it by one token.
            length = self.cache_tokens - tokens + 1 + (1 if kind == "limit_over" else 0)
            ids = [rng.randint(10, 200) for _ in range(length)]
            return (
                "/v1/completions",
                {"model": "soak", "prompt": ids, "max_tokens": tokens, "temperature": 0},
                False,
            )
        path, body, _ = rng.choice(BAD_REQUESTS)
        return path, body, False

    async def send(self, client: httpx.AsyncClient, kind: str) -> Outcome:
        path, body, stream = self.body(kind)
        outcome = Outcome(kind)
        start = time.perf_counter()
        try:
            if kind == "cancel":
                await self.cancelled(client, path, body, outcome)
            elif stream:
                await self.streamed(client, path, body, kind, outcome)
            else:
                await self.whole(client, path, body, kind, outcome)
        except httpx.HTTPError as error:
            outcome.problem = f"{type(error).__name__}: {error}"
        outcome.seconds = time.perf_counter() - start
        return outcome

    def expected_status(self, kind: str, body: Any) -> int:
        if kind == "limit_over":
            return 400
        if kind == "bad_request":
            return next(status for _, bad, status in BAD_REQUESTS if bad == body)
        return 200

    async def whole(
        self, client: httpx.AsyncClient, path: str, body: Any, kind: str, outcome: Outcome
    ) -> None:
        content = body if isinstance(body, str) else json.dumps(body)
        response = await client.post(
            self.url + path, content=content, headers={"content-type": "application/json"}
        )
        outcome.status = response.status_code
        expected = self.expected_status(kind, body)
        if response.status_code != expected:
            outcome.problem = f"HTTP {response.status_code}, expected {expected}: {response.text[:300]}"
            return
        answer = response.json()
        if expected != 200:
            outcome.ok = "error" in answer and bool(answer["error"].get("message"))
            if not outcome.ok:
                outcome.problem = f"a {expected} without an error body: {answer}"
            return
        want = body.get("n", 1)
        reasons = [choice.get("finish_reason") for choice in answer.get("choices", [])]
        if len(reasons) != want or not all(reasons):
            outcome.problem = f"choices not all finished: {reasons}"
            return
        outcome.ok = True

    async def streamed(
        self, client: httpx.AsyncClient, path: str, body: Any, kind: str, outcome: Outcome
    ) -> None:
        done = 0
        finishes: Counter[int] = Counter()
        chunks = 0
        async with client.stream("POST", self.url + path, json=body) as response:
            outcome.status = response.status_code
            if response.status_code != 200:
                outcome.problem = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return
            async for line in sse_lines(response):
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done += 1
                    continue
                try:
                    chunk = json.loads(line[6:])
                except json.JSONDecodeError:
                    outcome.problem = f"malformed event: {line[:300]!r}"
                    return
                if "error" in chunk:
                    outcome.problem = f"error event: {chunk['error']}"
                    return
                chunks += 1
                for choice in chunk.get("choices", []):
                    if choice.get("finish_reason"):
                        finishes[choice["index"]] += 1
                if kind == "disconnect" and chunks >= 2:
                    outcome.ok = True  # the client leaves mid-stream: the server must cancel, not fail
                    return
        if done != 1 or sorted(finishes) != list(range(body.get("n", 1))) or set(finishes.values()) != {1}:
            outcome.problem = f"[DONE] x{done}, finish reasons per choice {dict(finishes)}"
            return
        outcome.ok = True

    async def cancelled(self, client: httpx.AsyncClient, path: str, body: Any, outcome: Outcome) -> None:
        try:
            response = await client.post(self.url + path, json=body, timeout=self.rng.uniform(0.05, 0.5))
        except httpx.TimeoutException:
            outcome.ok = True  # the client stopped waiting: the server cancels the request
            return
        outcome.status = response.status_code
        outcome.ok = response.status_code == 200
        if not outcome.ok:
            outcome.problem = f"HTTP {response.status_code}: {response.text[:300]}"


async def wait_idle(url: str) -> dict[str, float]:
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while True:
        values = metrics(url)
        busy = {
            k: values.get(k, 0.0)
            for k in ("queue_depth", "running_requests", "kv_pages_in_use", "state_slots_in_use")
        }
        if not any(busy.values()) or time.monotonic() > deadline:
            return {**busy, "requests_failed": values.get("requests_failed", 0.0)}
        await asyncio.sleep(0.2)


async def soak(url: str, pid: int, args: argparse.Namespace) -> Books:
    books = Books()
    rng = random.Random(args.seed)
    traffic = Traffic(url, args, rng)
    kinds, weights = list(MIX), list(MIX.values())
    start = time.monotonic()
    end = start + args.duration
    paused = asyncio.Event()
    paused.set()
    in_flight = 0

    async def client_loop(client: httpx.AsyncClient) -> None:
        nonlocal in_flight
        while time.monotonic() < end:
            await paused.wait()
            if time.monotonic() >= end:
                return
            kind = rng.choices(kinds, weights)[0]
            in_flight += 1
            try:
                books.outcomes.append(await traffic.send(client, kind))
            finally:
                in_flight -= 1

    async def sample_rss() -> None:
        while time.monotonic() < end:
            value = rss_bytes(pid)
            if value is not None:
                books.rss.append((time.monotonic() - start, value))
            await asyncio.sleep(1.0)

    async def pauses() -> None:
        next_pause = start + args.idle_every
        while next_pause < end - 5:
            await asyncio.sleep(max(0.0, next_pause - time.monotonic()))
            paused.clear()
            while in_flight:
                await asyncio.sleep(0.05)
            books.idle_checks.append({"at_s": round(time.monotonic() - start, 1), **(await wait_idle(url))})
            paused.set()
            next_pause += args.idle_every

    limits = httpx.Limits(max_connections=args.concurrency * 2)
    async with httpx.AsyncClient(timeout=args.request_timeout, limits=limits) as client:
        await asyncio.gather(sample_rss(), pauses(), *(client_loop(client) for _ in range(args.concurrency)))
    books.idle_checks.append({"at_s": round(time.monotonic() - start, 1), **(await wait_idle(url))})
    return books


def judge(books: Books, exit_code: int | None, args: argparse.Namespace) -> tuple[list[str], dict[str, Any]]:
    problems = []
    bad = [o for o in books.outcomes if not o.ok]
    for outcome in bad[:20]:
        problems.append(f"{outcome.kind}: {outcome.problem}")
    if len(bad) > 20:
        problems.append(f"... and {len(bad) - 20} more requests not answered as expected")
    server_errors = [o for o in books.outcomes if o.status is not None and o.status >= 500]
    if server_errors:
        problems.append(f"{len(server_errors)} answers were 5xx")
    for check in books.idle_checks:
        busy = {k: v for k, v in check.items() if k not in ("at_s",) and v}
        if busy:
            problems.append(f"not idle (or failed requests) at {check['at_s']} s: {busy}")
    warm = [rss for at, rss in books.rss if at <= args.warmup]
    after = [rss for at, rss in books.rss if at > args.warmup]
    peak = max(warm) if warm else None
    late_peak = max(after) if after else None
    if peak is not None and late_peak is not None and late_peak > peak * (1 + RSS_TOLERANCE):
        problems.append(
            f"resident memory grew after warm-up: {peak / 2**20:.1f} -> {late_peak / 2**20:.1f} MiB"
        )
    if exit_code != 0:
        problems.append(f"the server exited with {exit_code} after SIGTERM")
    by_kind: dict[str, dict[str, int]] = {}
    for outcome in books.outcomes:
        row = by_kind.setdefault(outcome.kind, {"sent": 0, "as_expected": 0})
        row["sent"] += 1
        row["as_expected"] += outcome.ok
    figures = {
        "requests": len(books.outcomes),
        "as_expected": len(books.outcomes) - len(bad),
        "statuses": dict(Counter(str(o.status) for o in books.outcomes)),
        "by_kind": by_kind,
        "idle_checks": books.idle_checks,
        "rss_mib": {
            "warmup_peak": round(peak / 2**20, 1) if peak else None,
            "after_warmup_peak": round(late_peak / 2**20, 1) if late_peak else None,
            "last": round(books.rss[-1][1] / 2**20, 1) if books.rss else None,
            "growth": round(late_peak / peak - 1, 4) if peak and late_peak else None,
            # The curve, a point per half minute (the largest sample of each), to see a leak from a plateau.
            "series": rss_series(books.rss, 30.0),
        },
        "exit_code": exit_code,
    }
    return problems, figures


def rss_series(samples: list[tuple[float, int]], every: float) -> list[tuple[float, float]]:
    """(seconds, MiB) per `every` seconds: the largest sample in each interval."""
    buckets: dict[int, int] = {}
    for at, value in samples:
        bucket = int(at // every)
        buckets[bucket] = max(buckets.get(bucket, 0), value)
    return [(bucket * every, round(value / 2**20, 1)) for bucket, value in sorted(buckets.items())]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of traffic (default: 120)")
    parser.add_argument(
        "--warmup",
        type=float,
        default=None,
        help="seconds before memory must stay flat (default: a quarter, at most 300)",
    )
    parser.add_argument(
        "--idle-every",
        type=float,
        default=None,
        help="pause for an idle check every this many seconds (default: half the duration, at most 600)",
    )
    parser.add_argument("--model", default="tiny", help="as `transformers-cb serve --model` (default: tiny)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=64, help="the cache's pages (prompts at its limit)")
    parser.add_argument("--request-timeout", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--serve-arg", action="append", default=[], help="one more flag for the server")
    parser.add_argument("--json", default=None)
    parser.add_argument("--verbose", action="store_true", help="echo the server's output")
    args = parser.parse_args(argv)
    args.warmup = min(args.duration / 4, 300.0) if args.warmup is None else args.warmup
    args.idle_every = min(args.duration / 2, 600.0) if args.idle_every is None else args.idle_every
    process, url = start_server(args)
    exit_code: int | None = None
    try:
        books = asyncio.run(soak(url, process.pid, args))
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        try:
            exit_code = process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
    problems, figures = judge(books, exit_code, args)
    figures = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        **figures,
    }
    print(
        f"soak: {figures['requests']} requests in {args.duration:.0f} s, {figures['as_expected']} as expected"
    )
    print("| kind | sent | as expected |")
    print("|---|---|---|")
    for kind, row in sorted(figures["by_kind"].items()):
        print(f"| {kind} | {row['sent']} | {row['as_expected']} |")
    print(f"statuses: {figures['statuses']}; idle checks: {figures['idle_checks']}")
    print(f"resident memory (MiB): {figures['rss_mib']}; exit status after SIGTERM: {exit_code}")
    if args.json:
        Path(args.json).write_text(json.dumps({**figures, "problems": problems}, indent=1))
    for problem in problems:
        print("SOAK FAILED:", problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
