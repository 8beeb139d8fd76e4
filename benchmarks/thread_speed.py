"""Forward speed on the main thread vs a background thread, with and without `transformers_cb.manager.torch_threads.threads`.

    python benchmarks/thread_speed.py [--models small] [--workloads decode,decode64,prefill] [--repeats 5]
                                      [--iters 5] [--threads N] [--json out.json]

For every model and workload, each repetition times (median of `--iters` forwards, after warm-up forwards):

    main          the forward on the main thread (the only OpenMP team in the process)
    worker        a fresh `threading.Thread` right after the main thread used torch, as a naive background thread
                  does it: nothing applied, so grad mode is on
    worker+inf    the same thread entering `torch.inference_mode()` (isolates the OpenMP effect)
    worker+fix    `ThreadSettings.capture()` in the main thread (which also releases its idle OpenMP team), then
                  `apply()` and `torch.inference_mode()` in the worker (`worker_thread_context`)

and divides each worker time by the mean of the main-thread times measured just before and after it, so machine
noise shared by the neighbours cancels. The table shows the median over repetitions. `csw/fwd` columns count
voluntary context switches per forward (process-wide): OpenMP threads sleeping on a futex between parallel regions.
It does not depend on machine load, unlike the times. `other CPUs busy` is how many CPUs other processes kept busy
(from /proc/stat) during the kept triplets, median and max: on a busy machine spinning OpenMP threads compete with
other processes and the main-thread baseline itself degrades badly (it can become several times slower than a worker),
so a triplet disturbed by more than `--quiet` CPUs is measured again, up to `--retries` times.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import MODEL_CONFIGS, build_model, environment_metadata, param_count  # noqa: E402

from transformers_cb.manager.torch_threads.threads import (  # noqa: E402
    ThreadSettings,
    release_openmp_pool,
    worker_thread_context,
)

#: name -> (batch, sequence length) of a forward without KV cache.
WORKLOADS: dict[str, tuple[int, int]] = {
    "decode": (32, 1),  # 32 sequences, one token each: the matmul shapes of a decode step
    "decode64": (1, 64),  # 64 tokens in one row: a small mixed / chunked step
    "prefill": (1, 512),  # one 512-token prompt
}
VARIANTS = ("main", "worker", "worker+inf", "worker+fix")
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "thread_speed.json"


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _optional_float(value: str) -> float | None:
    return None if value.lower() in ("none", "off", "") else float(value)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--models", type=_csv, default=["small"], help=f"comma list of: {', '.join(MODEL_CONFIGS)}"
    )
    p.add_argument(
        "--workloads", type=_csv, default=list(WORKLOADS), help=f"comma list of: {', '.join(WORKLOADS)}"
    )
    p.add_argument("--repeats", type=int, default=5, help="repetitions (the table shows medians)")
    p.add_argument("--iters", type=int, default=5, help="timed forwards per measurement (median kept)")
    p.add_argument("--warmup", type=int, default=2, help="untimed forwards before each measurement")
    p.add_argument(
        "--quiet",
        type=_optional_float,
        default=0.25,
        help="re-measure a main/worker/main triplet while other processes kept more CPUs than this busy "
        "('off': never)",
    )
    p.add_argument(
        "--retries", type=int, default=4, help="re-measurements of a disturbed triplet before keeping it"
    )
    p.add_argument("--retry-wait", type=float, default=2.0, help="seconds to wait before re-measuring")
    p.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (default: torch's default)"
    )
    p.add_argument(
        "--json", type=Path, default=None, help=f"write rows + metadata as JSON (e.g. {DEFAULT_JSON})"
    )
    args = p.parse_args(argv)
    for name in args.models:
        if name not in MODEL_CONFIGS:
            p.error(f"unknown model {name!r}")
    for name in args.workloads:
        if name not in WORKLOADS:
            p.error(f"unknown workload {name!r}")
    return args


class Timer:
    """Times forwards of one model on one input in the calling thread."""

    def __init__(self, model: torch.nn.Module, inputs: torch.Tensor, iters: int, warmup: int) -> None:
        self.model, self.inputs, self.iters, self.warmup = model, inputs, iters, warmup

    def __call__(self) -> tuple[float, float]:
        """(median seconds per forward, voluntary context switches per forward) in the current thread's modes."""
        for _ in range(self.warmup):
            self.model(self.inputs, use_cache=False)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
        times = []
        for _ in range(self.iters):
            start = time.perf_counter()
            self.model(self.inputs, use_cache=False)
            times.append(time.perf_counter() - start)
        switches = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - before
        return statistics.median(times), switches / self.iters


def _cpu_snapshot() -> tuple[float, float, float] | None:
    """(wall s, machine busy CPU s, this process's CPU s), or None without /proc/stat."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(x) for x in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    own = os.times()
    return time.monotonic(), (sum(fields[:8]) - idle) / ticks, own.user + own.system


def _foreign_cpu(start: tuple[float, float, float] | None) -> float | None:
    """Average number of CPUs other processes kept busy since `start` (machine noise)."""
    end = _cpu_snapshot()
    if start is None or end is None or end[0] <= start[0]:
        return None
    return max(0.0, ((end[1] - start[1]) - (end[2] - start[2])) / (end[0] - start[0]))


def _in_thread(body: Callable[[], tuple[float, float]]) -> tuple[float, float]:
    """Run `body` in a fresh thread; the thread (and its OpenMP team) ends before this returns."""
    result: list[tuple[float, float]] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            result.append(body())
        except BaseException as error:  # noqa: BLE001 - re-raised in the caller
            errors.append(error)

    thread = threading.Thread(target=run, name="thread-speed-worker")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return result[0]


def measure(variant: str, timer: Timer) -> tuple[float, float]:
    if variant == "main":
        with torch.inference_mode():
            return timer()
    if variant == "worker":
        return _in_thread(timer)
    if variant == "worker+inf":

        def with_inference_mode() -> tuple[float, float]:
            with torch.inference_mode():
                return timer()

        return _in_thread(with_inference_mode)
    if variant == "worker+fix":
        settings = ThreadSettings.capture()  # main thread: also releases its idle OpenMP team

        def fixed() -> tuple[float, float]:
            with worker_thread_context(settings):
                return timer()

        return _in_thread(fixed)
    raise ValueError(variant)


def bench_one(model: torch.nn.Module, shape: tuple[int, int], args: argparse.Namespace) -> dict[str, Any]:
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randint(3, vocab, shape, generator=generator)
    timer = Timer(model, inputs, args.iters, args.warmup)
    workers = [v for v in VARIANTS if v != "main"]
    main_times: list[float] = []
    main_switches: list[float] = []
    times: dict[str, list[float]] = {v: [] for v in workers}
    ratios: dict[str, list[float]] = {v: [] for v in workers}
    switches: dict[str, list[float]] = {v: [] for v in workers}
    foreign: list[float] = []
    retried = 0
    measure("main", timer)  # warm the main thread's OpenMP team
    for rep in range(args.repeats):
        order = workers[rep % len(workers) :] + workers[: rep % len(workers)]  # rotate against drift
        for variant in order:
            for attempt in range(args.retries + 1):
                snapshot = _cpu_snapshot()
                before, before_csw = measure("main", timer)
                elapsed, csw = measure(variant, timer)
                after, after_csw = measure("main", timer)
                busy = _foreign_cpu(snapshot)
                if busy is None or args.quiet is None or busy <= args.quiet or attempt == args.retries:
                    break
                retried += 1  # other processes disturbed this triplet: measure it again
                time.sleep(args.retry_wait)
            main_times += [before, after]
            main_switches += [before_csw, after_csw]
            times[variant].append(elapsed)
            switches[variant].append(csw)
            ratios[variant].append(elapsed / ((before + after) / 2))
            if busy is not None:
                foreign.append(busy)
    return {
        "main_ms": statistics.median(main_times) * 1e3,
        "main_csw_per_forward": statistics.median(main_switches),
        **{f"{v}_ms": statistics.median(times[v]) * 1e3 for v in workers},
        **{f"{v}_ratio": statistics.median(ratios[v]) for v in workers},
        **{f"{v}_ratios": [round(r, 3) for r in ratios[v]] for v in workers},
        **{f"{v}_csw_per_forward": statistics.median(switches[v]) for v in workers},
        "foreign_cpus": [round(x, 3) for x in foreign],
        "foreign_cpus_max": max(foreign) if foreign else None,
        "retried_triplets": retried,
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    workers = [v for v in VARIANTS if v != "main"]
    header = ["model", "workload", "shape", "main ms"]
    header += [f"{v} ms (x main)" for v in workers]
    header += ["csw/fwd main"] + [f"csw/fwd {v}" for v in workers] + ["other CPUs busy"]
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for row in rows:
        cells = [row["model"], row["workload"], "x".join(map(str, row["shape"])), f"{row['main_ms']:.2f}"]
        cells += [f"{row[f'{v}_ms']:.2f} ({row[f'{v}_ratio']:.2f}x)" for v in workers]
        cells += [f"{row['main_csw_per_forward']:.0f}"] + [
            f"{row[f'{v}_csw_per_forward']:.0f}" for v in workers
        ]
        foreign = row["foreign_cpus"]
        cells.append(f"{statistics.median(foreign):.2f} (max {max(foreign):.2f})" if foreign else "?")
        print("| " + " | ".join(cells) + " |")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    rows: list[dict[str, Any]] = []
    for name in args.models:
        model = build_model(name)
        for workload in args.workloads:
            shape = WORKLOADS[workload]
            row = {"model": name, "params": param_count(model), "workload": workload, "shape": list(shape)}
            row.update(bench_one(model, shape, args))
            rows.append(row)
            print(
                f"# {name} {workload}: worker {row['worker_ratio']:.2f}x, worker+inf {row['worker+inf_ratio']:.2f}x, "
                f"worker+fix {row['worker+fix_ratio']:.2f}x of main ({row['main_ms']:.2f} ms)",
                file=sys.stderr,
                flush=True,
            )
        del model
    release_openmp_pool()
    print_table(rows)
    if args.json is not None:
        meta = environment_metadata(torch.get_num_threads())
        meta.update(
            repeats=args.repeats, iters=args.iters, warmup=args.warmup, quiet=args.quiet, retries=args.retries
        )
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"metadata": meta, "rows": rows}, indent=2) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
