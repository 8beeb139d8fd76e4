"""Ray Data scale-out: one workload through `CBPredictor` actors (1, 2, ...) next to one plain process.

    python benchmarks/ray_scale_out.py [--workload many-short] [--model mini] [--actors 1,2] [--batch-size 250]
                                       [--num-cpus 2] [--json out.json]

Starts a local Ray cluster of `--num-cpus` CPUs, saves the benchmark model to a temporary directory (each
actor loads it with `from_pretrained`, as on a cluster), and runs, side by side in one run:
  - `process`: the same batches through one warm `CBPredictor` in this process, one after the other (no
    Ray), on 1 torch thread (what Ray gives a 1-CPU actor: OMP_NUM_THREADS=1; `--process-threads` for more),
    before Ray starts;
  - `ray xN`: `ray.data.from_items(...).map_batches(CBPredictor, compute=ActorPoolStrategy(size=N))` over the same rows,
    one CPU per actor, timed from the dataset's creation to the last row (actor starts included).
`generation s` is the span from the first batch's start to the last batch's end (actor starts excluded).
It also times the start of one actor (process, imports, model load: `ray.get(actor.__ray_ready__)`) and the
model load inside `__init__` (`CBPredictor.load_s`). Every run's token ids are checked against `process`.
Ratios, not absolute numbers, are what compare (the machine is shared). See docs/scale_out.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (  # noqa: E402
    MODEL_CONFIGS,
    build_model,
    cpu_snapshot,
    make_workload,
    markdown_table,
    other_load,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--workload", default="many-short", help="a benchmarks/common.py workload (default many-short)"
    )
    p.add_argument("--model", default="mini", choices=sorted(MODEL_CONFIGS), help="default: mini")
    p.add_argument("--actors", default="1,2", help="comma list of actor counts (default 1,2)")
    p.add_argument("--batch-size", type=int, default=250, help="rows per actor call (default 250)")
    p.add_argument("--num-cpus", type=int, default=2, help="CPUs of the local Ray cluster (default 2)")
    p.add_argument(
        "--process-threads", default="1", help="comma list: torch threads of the in-process runs (default 1)"
    )
    p.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    return p.parse_args(argv)


def save_model(name: str, directory: Path) -> Path:
    """The benchmark model (eos disabled) plus the CLI's byte tokenizer, in `save_pretrained` layout."""
    from transformers_cb.models.tiny import build_tiny_tokenizer

    build_model(name).save_pretrained(directory)
    build_tiny_tokenizer().save_pretrained(directory)  # never decodes here: detokenize=False
    return directory


def predictor_kwargs(model_dir: Path) -> dict[str, Any]:
    # No eos (as in every benchmark engine): each request generates exactly its max_new_tokens.
    return {"model": str(model_dir), "detokenize": False, "generation_config": {"eos_token_id": None}}


class TimedPredictor:
    """`CBPredictor` that stamps each batch with its wall-clock start and end (`time.time()`: one clock for
    every process of this machine), so the run's generation span excludes the actors' start."""

    def __init__(self, **kwargs: Any) -> None:
        from transformers_cb.scale_out.predictor import CBPredictor

        self.predictor = CBPredictor(**kwargs)

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        import numpy as np
        import torch

        start = time.time()
        out = self.predictor(batch)
        rows = len(out["status"])
        out["batch_start"], out["batch_end"] = np.full(rows, start), np.full(rows, time.time())
        out["threads"] = np.full(rows, torch.get_num_threads())
        return out


def idle_load(seconds: float = 1.0) -> float | None:
    """Cores other processes keep busy while this one waits (the shared machine's load before a run)."""
    start = cpu_snapshot()
    time.sleep(seconds)
    return other_load(start, cpu_snapshot())


def workload_rows(workload: Any) -> list[dict[str, Any]]:
    return [
        {"row": i, "prompt_token_ids": r.prompt, "max_new_tokens": r.max_new_tokens}
        for i, r in enumerate(workload.requests)
    ]


def run_process(
    model_dir: Path, workload: Any, threads: int, batch_size: int
) -> tuple[float, list[list[int]]]:
    """The actors' work in this process: one `CBPredictor`, the same batches one after the other, warm
    (a first batch of the warmup workload), on `threads` torch threads."""
    import torch

    from benchmarks.common import make_warmup_workload
    from transformers_cb.scale_out.predictor import CBPredictor

    torch.set_num_threads(threads)
    predictor = CBPredictor(**predictor_kwargs(model_dir))
    predictor(_columns(workload_rows(make_warmup_workload(MODEL_CONFIGS["mini"]["vocab_size"]))))
    rows = workload_rows(workload)
    start = time.perf_counter()
    tokens = []
    for first in range(0, len(rows), batch_size):
        out = predictor(_columns(rows[first : first + batch_size]))
        tokens += [[int(t) for t in ids] for ids in out["generated_token_ids"]]
    return time.perf_counter() - start, tokens


def _columns(rows: list[dict[str, Any]]) -> dict[str, list[Any]]:
    return {name: [row[name] for row in rows] for name in rows[0]}


def run_ray(
    model_dir: Path, workload: Any, actors: int, batch_size: int
) -> tuple[float, float, list[list[int]]]:
    """(wall from the dataset's creation to its last row, first batch start to last batch end, tokens)."""
    import ray

    start = time.perf_counter()
    dataset = ray.data.from_items(workload_rows(workload)).map_batches(
        TimedPredictor,
        fn_constructor_kwargs=predictor_kwargs(model_dir),
        batch_size=batch_size,
        compute=ray.data.ActorPoolStrategy(size=actors),
        num_cpus=1,
    )
    out = sorted(dataset.take_all(), key=lambda r: r["row"])
    wall = time.perf_counter() - start
    span = max(r["batch_end"] for r in out) - min(r["batch_start"] for r in out)
    threads = sorted({int(r["threads"]) for r in out})
    return wall, span, threads, [[int(t) for t in r["generated_token_ids"]] for r in out]


def actor_start(model_dir: Path) -> tuple[float, float]:
    """(seconds until one fresh actor is ready, seconds of its model load in `__init__`)."""
    import ray

    from transformers_cb.scale_out.predictor import CBPredictor

    start = time.perf_counter()
    actor = ray.remote(num_cpus=1)(CBPredictor).remote(**predictor_kwargs(model_dir))
    ray.get(actor.__ray_ready__.remote())
    ready = time.perf_counter() - start
    load = ray.get(actor.__ray_call__.remote(lambda self: self.load_s))
    ray.kill(actor)
    return ready, load


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    workload = make_workload(args.workload, MODEL_CONFIGS[args.model]["vocab_size"])
    root = str(Path(__file__).resolve().parent.parent)
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_model(args.model, Path(tmp))
        ready, model_load = run_all(args, workload, model_dir, root, results)
    return report(args, workload, results, ready, model_load)


def run_all(
    args: argparse.Namespace, workload: Any, model_dir: Path, root: str, results: list[dict[str, Any]]
) -> tuple[float, float]:
    """The in-process runs (before Ray starts), then the Ray runs; (actor ready s, model load s)."""
    import ray

    reference = None
    for threads in [int(n) for n in args.process_threads.split(",")]:
        load = idle_load()
        wall, tokens = run_process(model_dir, workload, threads, args.batch_size)
        reference = reference or tokens
        label = f"process ({threads} thread{'s' if threads > 1 else ''})"
        results.append(
            {"engine": label, "wall_s": wall, "span_s": wall, "threads": threads, "other_load": load}
            | {"matches": tokens == reference}
        )
    ray.init(
        num_cpus=args.num_cpus,
        include_dashboard=False,
        logging_level="WARNING",
        runtime_env={"env_vars": {"PYTHONPATH": root, "TOKENIZERS_PARALLELISM": "false"}},
    )
    ray.data.DataContext.get_current().enable_progress_bars = False
    try:
        for count in [int(n) for n in args.actors.split(",")]:
            load = idle_load()
            wall, span, threads, tokens = run_ray(model_dir, workload, count, args.batch_size)
            results.append(
                {"engine": f"ray x{count}", "wall_s": wall, "span_s": span, "other_load": load}
                | {"threads": ",".join(map(str, threads)), "matches": tokens == reference}
            )
        return actor_start(model_dir)
    finally:
        ray.shutdown()


def report(
    args: argparse.Namespace, workload: Any, results: list[dict[str, Any]], ready: float, model_load: float
) -> int:
    base = results[0]["wall_s"]
    for row in results:
        row["req_per_s"] = len(workload.requests) / row["span_s"]
        row["vs_process"] = base / row["span_s"]
    columns = [
        ("engine", "engine"),
        ("wall_s", "wall s (with actor starts)"),
        ("span_s", "generation s (first batch to last)"),
        ("req_per_s", "requests/s (generation)"),
        ("vs_process", "generation speed vs process"),
        ("threads", "torch threads (each)"),
        ("matches", "tokens == process"),
        ("other_load", "other load (cores)"),
    ]
    print(
        f"workload {args.workload} ({len(workload.requests)} requests), model {args.model}, "
        f"Ray cluster of {args.num_cpus} CPUs, batch size {args.batch_size}"
    )
    print(markdown_table(results, columns))
    print(f"one actor's start: {ready:.2f} s until ready, of which model load in __init__ {model_load:.2f} s")
    if args.json is not None:
        args.json.write_text(
            json.dumps({"rows": results, "actor_ready_s": ready, "model_load_s": model_load})
        )
    return 0 if all(r["matches"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
