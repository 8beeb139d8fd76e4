"""Online (serving) benchmark: Poisson arrivals, streaming and plain requests, TTFT / inter-token / end-to-end latency.

    python benchmarks/online.py                                  # small model, rates 1,2,4 req/s, 32 requests per rate
    python benchmarks/online.py --model tiny --scale 0.25        # quick run
    python benchmarks/online.py --rates 1,2 --requests 24 --repeats 2

Two continuous batching managers serve the same seeded request stream, one after the other in the same process,
interleaved rate by rate (and repeat by repeat, alternating which engine goes first):

    builtin  transformers' own `ContinuousBatchingManager` (through the unpatched `ContinuousMixin`)
    ours     `transformers_cb`'s `ContinuousBatchingManager`

For each (rate, engine) run a fresh manager is created and started, warmed up with two short requests, and then a
client (the main thread) submits the requests at their Poisson arrival times. Every output is handed to one consumer
thread per engine, which timestamps it on receipt (the *client-side* times, the primary metrics); each engine's own
token timestamps are kept as well (*engine-side*: `record_timestamps=True` for the built-in, the time its result
callback ran in the manager thread for ours). See `docs/benchmarks.md` ("Online benchmark").
"""

from __future__ import annotations

import argparse
import json
import math
import queue
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import (  # noqa: E402
    FIRST_PROMPT_TOKEN,
    MODEL_CONFIGS,
    Request,
    Workload,
    build_model,
    compare_outputs,
    cpu_snapshot,
    environment_metadata,
    greedy_generation_config,
    make_config,
    markdown_table,
    other_load,
    param_count,
    reference_indices,
    reference_outputs,
    wait_for_quiet_cpu,
)

ENGINES = ("builtin", "ours")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------------------------------
# Workload: requests, streaming flags, Poisson arrival times
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class OnlineWorkload:
    requests: list[Request]
    streaming: list[bool]
    description: str

    @property
    def workload(self) -> Workload:
        return Workload("online", self.requests, description=self.description)


def make_online_workload(
    num_requests: int,
    vocab_size: int,
    prompt_range: tuple[int, int],
    new_tokens_range: tuple[int, int],
    streaming_fraction: float,
    seed: int,
) -> OnlineWorkload:
    """Seeded requests: prompt length and max_new_tokens uniform in their ranges, token ids uniform in [3, vocab),
    exactly round(n * streaming_fraction) streaming requests at random positions. The same requests serve every
    rate, so only the arrival process changes from rate to rate."""
    rng = random.Random(f"online/{seed}")
    requests = []
    for _ in range(num_requests):
        plen = rng.randint(*prompt_range)
        mnt = rng.randint(*new_tokens_range)
        requests.append(Request([rng.randrange(FIRST_PROMPT_TOKEN, vocab_size) for _ in range(plen)], mnt))
    num_streaming = round(num_requests * streaming_fraction)
    streaming = [True] * num_streaming + [False] * (num_requests - num_streaming)
    rng.shuffle(streaming)
    description = (
        f"prompts uniform in {list(prompt_range)}, max_new_tokens uniform in {list(new_tokens_range)}, "
        f"{num_streaming}/{num_requests} streaming"
    )
    return OnlineWorkload(requests, streaming, description)


def poisson_arrivals(num_requests: int, rate: float, seed: int) -> list[float]:
    """Arrival offsets (seconds from the start of the run) of a Poisson process of `rate` requests/s."""
    rng = random.Random(f"online-arrivals/{seed}/{rate}")
    t, times = 0.0, []
    for _ in range(num_requests):
        t += rng.expovariate(rate)
        times.append(t)
    return times


def warmup_requests(vocab_size: int) -> list[Request]:
    rng = random.Random("online-warmup")
    return [
        Request([rng.randrange(FIRST_PROMPT_TOKEN, vocab_size) for _ in range(plen)], mnt)
        for plen, mnt in ((24, 6), (90, 4))
    ]


# --------------------------------------------------------------------------------------------------------------------
# Per-request timing records
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class Record:
    index: int
    streaming: bool
    max_new_tokens: int
    scheduled: float = 0.0  # absolute perf_counter time the request was due
    submitted: float = 0.0  # perf_counter just before add_request
    client_times: list[float] = field(default_factory=list)  # receipt time of each token (consumer thread)
    engine_times: list[float] = field(default_factory=list)  # each engine's own time of each token
    finished_at: float | None = None  # receipt time of the final output
    tokens: list[int] | None = None
    status: str | None = None
    error: str | None = None
    multi_token_outputs: int = 0  # streaming outputs that brought more than one new token at once

    def receive(self, received_at: float, generated: list[int], final: bool) -> None:
        new = len(generated) - len(self.client_times)
        if new > 1 and self.streaming:
            self.multi_token_outputs += 1
        self.client_times.extend([received_at] * max(new, 0))
        if final:
            self.finished_at = received_at
            self.tokens = list(generated)


class Collector:
    """Outputs pushed by an engine's delivery path, timestamped by one consumer thread."""

    def __init__(self, records: dict[str, Record]):
        self.records = records
        self.queue: queue.SimpleQueue[tuple[str, list[int], bool, Any] | None] = queue.SimpleQueue()
        self.remaining = len(records)
        self.done = threading.Event()
        if not records:
            self.done.set()

    def handle(
        self, request_id: str, generated: list[int], final: bool, output: Any, received_at: float
    ) -> None:
        record = self.records.get(request_id)
        if record is None:
            return
        record.receive(received_at, generated, final)
        if final:
            record.status = getattr(output.status, "name", str(output.status))
            record.error = output.error
            self.remaining -= 1
            if self.remaining == 0:
                self.done.set()


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def ms(value: float | None) -> float | None:
    return None if value is None else value * 1000


# --------------------------------------------------------------------------------------------------------------------
# Engine drivers
# --------------------------------------------------------------------------------------------------------------------


class OnlineEngine:
    """Creates a manager, serves one run, tears it down. Only one engine's manager thread lives at any time (two live
    OpenMP teams slow both down, see transformers_cb/threads.py)."""

    name = "engine"

    def __init__(self, model, settings: dict[str, Any], max_new_tokens: int):
        self.model = model
        self.settings = settings
        self.max_new_tokens = max_new_tokens
        self.notes: list[str] = []

    # subclasses: start(), submit(index, request, streaming) -> request id, collect thread, stop()
    def start(self, collector: Collector) -> None:
        raise NotImplementedError

    def submit(self, request_id: str, request: Request, streaming: bool) -> None:
        raise NotImplementedError

    def stop(self, hard: bool = False) -> None:
        raise NotImplementedError


class OursOnline(OnlineEngine):
    """`model.init_continuous_batching(...)`; every request is claimed at submission with
    `register_result_handler`, whose callback (manager thread) timestamps the output (engine-side time) and hands it
    to the consumer thread."""

    name = "ours"

    def start(self, collector: Collector) -> None:
        # transformers' own config class, as the documents and real clients build it: the plugin
        # converts it (this is the path users take).
        from transformers.generation import ContinuousBatchingConfig as TransformersConfig

        import transformers_cb  # noqa: F401

        cfg, ignored = make_config(TransformersConfig, self.settings)
        self.notes.append("config: transformers.generation.ContinuousBatchingConfig")
        if ignored:
            self.notes.append(f"ignored settings: {ignored}")
        self.collector = collector
        self.manager = self.model.init_continuous_batching(
            generation_config=greedy_generation_config(self.max_new_tokens),
            continuous_batching_config=cfg,
        )
        self.manager.start()  # captures this thread's torch settings and releases its idle OpenMP team
        self.consumer = threading.Thread(target=self._consume, name="ours-consumer", daemon=True)
        self.consumer.start()

    def _consume(self) -> None:
        while True:
            item = self.collector.queue.get()
            now = time.perf_counter()
            if item is None:
                return
            request_id, engine_time, output = item
            final = output.is_finished()
            record = self.collector.records.get(request_id)
            if record is not None:
                generated = output.generated_tokens
                new = len(generated) - len(record.engine_times)
                if final and output.first_token_time is not None and not record.engine_times:
                    # plain request: the engine recorded its first token's time
                    record.engine_times.append(output.first_token_time)
                    new -= 1
                record.engine_times.extend([engine_time] * max(new, 0))
            self.collector.handle(request_id, output.generated_tokens, final, output, now)

    def submit(self, request_id: str, request: Request, streaming: bool) -> None:
        rid = self.manager.add_request(
            request.prompt, request_id=request_id, max_new_tokens=request.max_new_tokens, streaming=streaming
        )
        put = self.collector.queue.put

        def on_output(output, rid=rid) -> None:
            put((rid, time.perf_counter(), output))

        self.manager.register_result_handler(rid, on_output)

    def stop(self, hard: bool = False) -> None:
        self.manager.stop(block=True, timeout=30, hard_stop=hard)
        self.manager.destroy()
        self.collector.queue.put(None)
        self.consumer.join(timeout=10)


class BuiltinOnline(OnlineEngine):
    """transformers' manager through `ContinuousMixin.init_continuous_batching(model, ...)` (the unpatched function).
    Its outputs (one per token for streaming requests, the final one for plain requests) all go to its shared
    `output_queue`; one consumer thread drains it with `get_result(timeout=...)`, the way its docs suggest consuming
    many concurrent streams without an asyncio loop. (`request_id_iter` polls the same queue and requeues outputs of
    other requests, so per-request consumer threads would delay each other; `register_result_handler` needs a
    running asyncio loop.) `record_timestamps=True` gives its engine-side token times."""

    name = "builtin"

    def start(self, collector: Collector) -> None:
        from transformers.generation import ContinuousBatchingConfig as BuiltinConfig
        from transformers.generation.continuous_batching.continuous_api import ContinuousMixin

        from transformers_cb.manager.torch_threads.threads import release_openmp_pool

        # CPU: no CUDA graphs, no compile (nothing else is needed: flash attention is unavailable, SDPA stays).
        cfg, ignored = make_config(
            BuiltinConfig, self.settings, {"use_cuda_graph": False, "default_compile_level": 0}
        )
        if ignored:
            self.notes.append(f"ignored settings: {ignored}")
        self.collector = collector
        generation_config = greedy_generation_config(self.max_new_tokens)
        generation_config.eos_token_id = -1  # what it substitutes for None anyway (with a warning)
        self.manager = ContinuousMixin.init_continuous_batching(
            self.model,
            generation_config=generation_config,
            continuous_batching_config=cfg,
        )
        # Same OpenMP state as ours gets from its own start(): the main thread's idle team (left by the reference
        # generate() calls) released, so only the manager thread's team is live whichever engine ran before.
        release_openmp_pool()
        self.manager.start()
        deadline = time.perf_counter() + 60
        while self.manager.batch_processor is None and time.perf_counter() < deadline:
            time.sleep(0.01)  # its cache and batch processor are built in the background thread
        self._stop_consumer = False
        self.consumer = threading.Thread(target=self._consume, name="builtin-consumer", daemon=True)
        self.consumer.start()

    def _consume(self) -> None:
        while not self._stop_consumer:
            output = self.manager.get_result(timeout=0.05)
            now = time.perf_counter()
            if output is None:
                continue
            final = output.is_finished()
            record = self.collector.records.get(output.request_id)
            if record is not None and final and output.timestamps is not None:
                record.engine_times = list(output.timestamps)
            self.collector.handle(output.request_id, output.generated_tokens, final, output, now)

    def submit(self, request_id: str, request: Request, streaming: bool) -> None:
        self.manager.add_request(
            request.prompt,
            request_id=request_id,
            max_new_tokens=request.max_new_tokens,
            streaming=streaming,
            record_timestamps=True,
        )

    def stop(self, hard: bool = False) -> None:
        self.manager.stop(block=True, timeout=30, hard_stop=hard)
        self._stop_consumer = True
        self.consumer.join(timeout=10)
        self.manager.destroy()


# --------------------------------------------------------------------------------------------------------------------
# One run
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class RunOutcome:
    engine: str
    rate: float
    repeat: int
    records: list[Record]
    start: float
    other_load: float | None
    client_lag_max_s: float
    timed_out: bool
    notes: list[str]


def serve(
    engine: OnlineEngine,
    work: OnlineWorkload,
    arrivals: list[float],
    warmup: list[Request],
    rate: float,
    repeat: int,
    run_timeout: float,
) -> RunOutcome:
    # Warm-up inside the same manager session (its thread's OpenMP team, allocator, first-step costs).
    warm_records = {f"warmup_{j}": Record(-1, True, r.max_new_tokens) for j, r in enumerate(warmup)}
    records = {
        f"r{rate:g}_{repeat}_{i}": Record(i, s, r.max_new_tokens)
        for i, (r, s) in enumerate(zip(work.requests, work.streaming, strict=True))
    }
    collector = Collector({**warm_records, **records})
    engine.start(collector)
    timed_out = False
    try:
        for j, r in enumerate(warmup):
            engine.submit(f"warmup_{j}", r, True)
        deadline = time.perf_counter() + 120
        while (
            any(rec.finished_at is None for rec in warm_records.values()) and time.perf_counter() < deadline
        ):
            time.sleep(0.01)
        time.sleep(0.2)
        snap = cpu_snapshot()
        start = time.perf_counter() + 0.05
        lag = 0.0
        for (rid, record), offset, request in zip(records.items(), arrivals, work.requests, strict=True):
            due = start + offset
            while (now := time.perf_counter()) < due:
                time.sleep(min(due - now, 0.05) if due - now > 0.002 else 0)
            record.scheduled = due
            record.submitted = time.perf_counter()
            lag = max(lag, record.submitted - due)
            engine.submit(rid, request, record.streaming)
        if not collector.done.wait(timeout=run_timeout):
            timed_out = True
        load = other_load(snap, cpu_snapshot())
    finally:
        engine.stop(hard=timed_out)
    return RunOutcome(
        engine.name,
        rate,
        repeat,
        list(records.values()),
        start,
        load,
        lag,
        timed_out,
        list(engine.notes),
    )


def summarize(outcome: RunOutcome) -> dict[str, Any]:
    recs = outcome.records
    done = [r for r in recs if r.finished_at is not None and r.error is None]
    streaming = [r for r in done if r.streaming and r.client_times]
    ttft = [r.client_times[0] - r.submitted for r in streaming]
    itl = [b - a for r in streaming for a, b in zip(r.client_times, r.client_times[1:], strict=False)]
    e2e = [r.finished_at - r.submitted for r in done]
    e2e_stream = [r.finished_at - r.submitted for r in done if r.streaming]
    e2e_plain = [r.finished_at - r.submitted for r in done if not r.streaming]
    engine_ttft = [r.engine_times[0] - r.submitted for r in streaming if r.engine_times]
    engine_ttft_all = [r.engine_times[0] - r.submitted for r in done if r.engine_times]
    engine_itl = [b - a for r in streaming for a, b in zip(r.engine_times, r.engine_times[1:], strict=False)]
    # Delivery delay: consumer receipt minus the engine's own timestamp, per token of the streaming requests.
    delivery = [c - e for r in streaming for c, e in zip(r.client_times, r.engine_times, strict=False)]
    gen_tokens = sum(len(r.tokens or []) for r in done)
    end = max((r.finished_at for r in done), default=outcome.start)
    span = end - outcome.start
    errors = [
        f"{r.index}: {r.status} {r.error}" if r.finished_at is not None else f"{r.index}: no final output"
        for r in recs
        if r.finished_at is None or r.error is not None
    ]
    errors += [
        f"{r.index}: {len(r.tokens or [])} tokens, expected {r.max_new_tokens}"
        for r in done
        if len(r.tokens or []) != r.max_new_tokens
    ]
    return {
        "rate": outcome.rate,
        "engine": outcome.engine,
        "repeat": outcome.repeat,
        "requests": len(recs),
        "completed": len(done),
        "streaming_completed": len(streaming),
        "ttft_p50_ms": ms(percentile(ttft, 50)),
        "ttft_p99_ms": ms(percentile(ttft, 99)),
        "itl_p50_ms": ms(percentile(itl, 50)),
        "itl_p99_ms": ms(percentile(itl, 99)),
        "itl_mean_ms": ms(sum(itl) / len(itl)) if itl else None,
        "e2e_p50_ms": ms(percentile(e2e, 50)),
        "e2e_p99_ms": ms(percentile(e2e, 99)),
        "e2e_streaming_p50_ms": ms(percentile(e2e_stream, 50)),
        "e2e_plain_p50_ms": ms(percentile(e2e_plain, 50)),
        "engine_ttft_p50_ms": ms(percentile(engine_ttft, 50)),
        "engine_ttft_p99_ms": ms(percentile(engine_ttft, 99)),
        "engine_ttft_all_p50_ms": ms(percentile(engine_ttft_all, 50)),
        "engine_ttft_all_p99_ms": ms(percentile(engine_ttft_all, 99)),
        "engine_itl_p50_ms": ms(percentile(engine_itl, 50)),
        "engine_itl_p99_ms": ms(percentile(engine_itl, 99)),
        "delivery_p50_ms": ms(percentile(delivery, 50)),
        "delivery_p99_ms": ms(percentile(delivery, 99)),
        "generated_tokens": gen_tokens,
        "span_s": span,
        "tokens_per_s": gen_tokens / span if span > 0 else None,
        "client_lag_max_ms": ms(outcome.client_lag_max_s),
        "multi_token_outputs": sum(r.multi_token_outputs for r in recs),
        "other_load": outcome.other_load,
        "timed_out": outcome.timed_out,
        "errors": errors,
        "notes": outcome.notes,
        "per_request": [
            {
                "index": r.index,
                "streaming": r.streaming,
                "max_new_tokens": r.max_new_tokens,
                "submitted_s": round(r.submitted - outcome.start, 4),
                "ttft_ms": ms(r.client_times[0] - r.submitted) if r.streaming and r.client_times else None,
                "engine_ttft_ms": ms(r.engine_times[0] - r.submitted) if r.engine_times else None,
                "e2e_ms": ms(r.finished_at - r.submitted) if r.finished_at is not None else None,
                "tokens": len(r.tokens or []),
            }
            for r in recs
        ],
    }


# --------------------------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------------------------


def parse_range(text: str) -> tuple[int, int]:
    lo, hi = (int(v) for v in text.split(","))
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"bad range {text!r}: expected LO,HI with 1 <= LO <= HI")
    return lo, hi


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="small", choices=sorted(MODEL_CONFIGS))
    parser.add_argument("--rates", default="1,2,4", help="arrival rates in requests/s, comma separated")
    parser.add_argument("--requests", type=int, default=32, help="requests per rate (before --scale)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies --requests (at least 2)")
    parser.add_argument("--streaming-fraction", type=float, default=0.5)
    parser.add_argument("--prompt-len", type=parse_range, default=(16, 256), help="LO,HI (uniform)")
    parser.add_argument("--max-new-tokens", type=parse_range, default=(16, 128), help="LO,HI (uniform)")
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--repeats", type=int, default=1, help="runs per (rate, engine), engines alternating")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument(
        "--ref-requests", type=int, default=4, help="requests checked against plain generate()"
    )
    parser.add_argument("--page-size", type=int, default=None)
    parser.add_argument("--max-batch-tokens", type=int, default=None)
    parser.add_argument("--num-blocks", type=int, default=None, help="default: every request at full length")
    parser.add_argument("--run-timeout", type=float, default=300.0, help="seconds after the last arrival")
    parser.add_argument("--wait-quiet", type=float, default=30.0)
    parser.add_argument("--quiet-load", type=float, default=0.25)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default="benchmarks/results/online.json")
    args = parser.parse_args(argv)

    rates = [float(r) for r in args.rates.split(",") if r.strip()]
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    for e in engines:
        if e not in ENGINES:
            parser.error(f"unknown engine {e!r}; choose from {ENGINES}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    num_requests = max(2, round(args.requests * args.scale))

    import transformers_cb  # noqa: F401  (patches PreTrainedModel.init_continuous_batching)

    # One model instance per engine (same seed, same weights) and one for the references: no attention switch of
    # one engine can leak into another.
    models = {name: build_model(args.model, seed=args.seed) for name in engines}
    ref_model = build_model(args.model, seed=args.seed)
    vocab = ref_model.config.vocab_size
    with torch.no_grad():
        sums = {name: float(sum(p.double().sum() for p in m.parameters())) for name, m in models.items()}
    if len(set(sums.values())) > 1:
        log(f"WARNING: model instances differ: {sums}")

    work = make_online_workload(
        num_requests, vocab, args.prompt_len, args.max_new_tokens, args.streaming_fraction, args.seed
    )
    max_new = max(r.max_new_tokens for r in work.requests)
    settings: dict[str, Any] = {}
    if args.page_size is not None:
        settings["page_size"] = args.page_size
    if args.max_batch_tokens is not None:
        settings["max_batch_tokens"] = args.max_batch_tokens
    page = args.page_size or 256
    settings["num_blocks"] = args.num_blocks or (
        sum(math.ceil((len(r.prompt) + r.max_new_tokens) / page) for r in work.requests) + 8
    )
    warm = warmup_requests(vocab)

    log(f"model {args.model}: {param_count(ref_model) / 1e6:.2f}M params, torch threads {threads}")
    log(f"workload: {num_requests} requests, {work.description}; settings {settings}")

    ref_idx = reference_indices(num_requests, args.ref_requests)
    t = time.perf_counter()
    refs = reference_outputs(ref_model, work.workload, ref_idx)
    log(f"references ({len(ref_idx)} requests with generate()): {time.perf_counter() - t:.1f}s")

    def make_engine(name: str) -> OnlineEngine:
        cls = OursOnline if name == "ours" else BuiltinOnline
        return cls(models[name], settings, max_new)

    # Global warm-up of each engine (lazy imports, first-time kernel choices).
    for name in engines:
        t = time.perf_counter()
        serve(
            make_engine(name), OnlineWorkload(warm, [True] * len(warm), "warmup"), [0.0, 0.01], [], 0, -1, 120
        )
        log(f"warmup {name}: {time.perf_counter() - t:.1f}s")

    rows: list[dict[str, Any]] = []
    outputs: dict[tuple[float, int, str], list[list[int] | None]] = {}
    run_index = 0
    for rate in rates:
        arrivals = poisson_arrivals(num_requests, rate, args.seed)
        for repeat in range(args.repeats):
            order = engines if run_index % 2 == 0 else engines[::-1]
            run_index += 1
            for name in order:
                if args.wait_quiet > 0:
                    waited, load = wait_for_quiet_cpu(args.quiet_load, args.wait_quiet)
                    if waited > 1:
                        log(f"  waited {waited:.1f}s for a quiet CPU (other load {load})")
                log(
                    f"rate {rate:g} req/s, repeat {repeat}, {name}: {num_requests} requests over ~{arrivals[-1]:.1f}s"
                )
                outcome = serve(
                    make_engine(name), work, arrivals, warm, rate, repeat, arrivals[-1] + args.run_timeout
                )
                row = summarize(outcome)
                rows.append(row)
                outputs[(rate, repeat, name)] = [r.tokens for r in outcome.records]
                log(
                    f"  done: ttft p50 {row['ttft_p50_ms'] or float('nan'):.1f} ms, itl p50 "
                    f"{row['itl_p50_ms'] or float('nan'):.1f} ms, {row['tokens_per_s'] or 0:.1f} tok/s, "
                    f"other load {row['other_load']}, errors {len(row['errors'])}"
                )

    # Correctness: references (sampled requests) and ours vs builtin (every request).
    ref_list: list[list[int] | None] = [refs.get(i) for i in range(num_requests)]
    mismatches: list[str] = []
    for row in rows:
        out = outputs[(row["rate"], row["repeat"], row["engine"])]
        agree = compare_outputs(out, ref_list, ref_idx)
        row["vs_ref"] = agree.short()
        row["vs_ref_detail"] = agree.as_dict()
        if agree.identical != agree.compared or agree.compared != len(ref_idx):
            mismatches.append(
                f"rate {row['rate']:g} {row['engine']}: vs generate() {agree.short()} {agree.first_divergence}"
            )
        if row["engine"] == "ours" and (row["rate"], row["repeat"], "builtin") in outputs:
            agree = compare_outputs(out, outputs[(row["rate"], row["repeat"], "builtin")])
            row["vs_builtin"] = agree.short()
            row["vs_builtin_detail"] = agree.as_dict()
            if agree.identical != agree.compared or agree.compared != num_requests:
                mismatches.append(
                    f"rate {row['rate']:g} repeat {row['repeat']}: ours vs builtin {agree.short()}, "
                    f"first divergences {agree.first_divergence}"
                )

    # Ratios ours / builtin per (rate, repeat).
    ratios: list[dict[str, Any]] = []
    keys = (
        "ttft_p50_ms",
        "ttft_p99_ms",
        "itl_p50_ms",
        "itl_p99_ms",
        "e2e_p50_ms",
        "e2e_p99_ms",
        "engine_ttft_p50_ms",
        "engine_itl_p50_ms",
    )
    by = {(r["rate"], r["repeat"], r["engine"]): r for r in rows}
    for rate in rates:
        for repeat in range(args.repeats):
            ours, builtin = by.get((rate, repeat, "ours")), by.get((rate, repeat, "builtin"))
            if not ours or not builtin:
                continue
            ratio = {"rate": rate, "repeat": repeat}
            for key in keys:
                a, b = ours.get(key), builtin.get(key)
                ratio[key] = a / b if a is not None and b else None
            ratio["tokens_per_s"] = (
                ours["tokens_per_s"] / builtin["tokens_per_s"]
                if ours["tokens_per_s"] and builtin["tokens_per_s"]
                else None
            )
            ratios.append(ratio)

    columns = [
        ("rate", "req/s"),
        ("engine", "engine"),
        ("completed", "done"),
        ("ttft_p50_ms", "TTFT p50 ms"),
        ("ttft_p99_ms", "TTFT p99 ms"),
        ("itl_p50_ms", "ITL p50 ms"),
        ("itl_p99_ms", "ITL p99 ms"),
        ("e2e_p50_ms", "E2E p50 ms"),
        ("e2e_p99_ms", "E2E p99 ms"),
        ("tokens_per_s", "gen tok/s"),
        ("engine_ttft_p50_ms", "eng TTFT p50"),
        ("engine_itl_p50_ms", "eng ITL p50"),
        ("other_load", "other load"),
        ("vs_ref", "= generate"),
        ("vs_builtin", "= builtin"),
    ]
    if args.repeats > 1:
        columns.insert(2, ("repeat", "rep"))
    table_rows = [{**r, "rate": f"{r['rate']:g}"} for r in rows]
    print(f"\n### Online: model {args.model}, {num_requests} requests per rate, {work.description}\n")
    print(markdown_table(table_rows, columns))
    if ratios:
        print("\nours / builtin (< 1: ours is lower, i.e. better for latencies; > 1 better for tok/s):\n")
        ratio_columns = [("rate", "req/s")] + ([("repeat", "rep")] if args.repeats > 1 else [])
        ratio_columns += [
            ("ttft_p50_ms", "TTFT p50"),
            ("ttft_p99_ms", "TTFT p99"),
            ("itl_p50_ms", "ITL p50"),
            ("itl_p99_ms", "ITL p99"),
            ("e2e_p50_ms", "E2E p50"),
            ("e2e_p99_ms", "E2E p99"),
            ("tokens_per_s", "tok/s"),
            ("engine_ttft_p50_ms", "eng TTFT p50"),
            ("engine_itl_p50_ms", "eng ITL p50"),
        ]
        print(markdown_table([{**r, "rate": f"{r['rate']:g}"} for r in ratios], ratio_columns))
    for row in rows:
        for err in row["errors"]:
            print(f"error: rate {row['rate']:g} {row['engine']}: {err}")
    for m in mismatches:
        print(f"mismatch: {m}")

    result = {
        "metadata": {
            **environment_metadata(threads),
            "args": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()},
            "model": {
                "name": args.model,
                "params": param_count(ref_model),
                "config": MODEL_CONFIGS[args.model],
            },
            "workload": {**work.workload.summary(), "streaming": sum(work.streaming)},
            "settings": settings,
            "reference_indices": ref_idx,
        },
        "rows": rows,
        "ratios": ratios,
        "mismatches": mismatches,
    }
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
