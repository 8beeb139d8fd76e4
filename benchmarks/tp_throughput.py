"""Tensor parallelism on CPU: `generate_batch` throughput with 1 rank vs N ranks (gloo), same workload.

    python benchmarks/tp_throughput.py [--model small] [--workload mixed] [--scale 0.125] [--ranks 2]

The model is built (seeded), saved to a temporary directory and loaded by every run from there:
1 rank without distribution (with all cores, and with 1 thread), and `--ranks` ranks under
`torchrun` with `DistributedConfig(tp_size=ranks)` (torchrun gives each rank 1 thread). Each run
warms up on a small workload, then times `generate_batch` over the workload once. Outputs of
every run are compared with the 1-rank run's (greedy, no EOS: they must be equal). On a 2-core
machine expect no speed-up: the point of tensor parallelism here is correctness, and each step
adds gloo all-reduces of the activations plus rank 0's step message.
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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (  # noqa: E402
    MODEL_CONFIGS,
    build_model,
    greedy_generation_config,
    make_warmup_workload,
    make_workload,
    markdown_table,
)


def worker(args: argparse.Namespace) -> None:
    from transformers import AutoModelForCausalLM, DistributedConfig

    import transformers_cb  # noqa: F401
    from transformers_cb import ContinuousBatchingConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    kwargs = {"distributed_config": DistributedConfig(tp_size=args.ranks)} if args.ranks > 1 else {}
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32, **kwargs).eval()
    model.generation_config.eos_token_id = None
    vocab = model.config.vocab_size
    config = ContinuousBatchingConfig(page_size=args.page_size)

    def run(workload):
        return model.generate_batch(
            workload.inputs,
            greedy_generation_config(max(workload.max_new_tokens)),
            config,
            progress_bar=False,
            max_new_tokens=workload.max_new_tokens,
        )

    run(make_warmup_workload(vocab))
    workload = make_workload(args.workload, vocab, args.scale)
    start = time.perf_counter()
    outputs = run(workload)
    seconds = time.perf_counter() - start
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        tokens = [outputs[f"req_{i}"].generated_tokens for i in range(len(workload.requests))]
        record = {"seconds": seconds, "generated": sum(map(len, tokens)), "tokens": tokens}
        Path(args.out).write_text(json.dumps(record))


def launch(args: argparse.Namespace, model_dir: str, ranks: int, threads: int | None, out: str) -> dict:
    command = [__file__, "--worker", "--model-dir", model_dir, "--ranks", str(ranks), "--out", out]
    command += ["--workload", args.workload, "--scale", str(args.scale), "--page-size", str(args.page_size)]
    if threads:
        command += ["--threads", str(threads)]
    if ranks > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), *command]
    else:
        command = [sys.executable, *command]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
    return json.loads(Path(out).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="small")
    parser.add_argument("--workload", default="mixed")
    parser.add_argument("--scale", type=float, default=0.125)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, args.model)
        build_model(args.model).save_pretrained(model_dir)
        runs = [
            ("1 rank", 1, os.cpu_count()),
            ("1 rank, 1 thread", 1, 1),
            (f"{args.ranks} ranks (tp_size={args.ranks}), 1 thread each", args.ranks, None),
        ]
        records = {}
        for name, ranks, threads in runs:
            print(f"running {name} ...", file=sys.stderr)
            records[name] = launch(args, model_dir, ranks, threads, os.path.join(tmp, f"{len(records)}.json"))
    base = records["1 rank"]
    rows = []
    for name, _ranks, _threads in runs:
        record = records[name]
        rows.append(
            {
                "run": name,
                "seconds": f"{record['seconds']:.2f}",
                "tok/s": f"{record['generated'] / record['seconds']:.1f}",
                "vs 1 rank": f"{base['seconds'] / record['seconds']:.2f}x",
                "outputs = 1 rank": "yes" if record["tokens"] == base["tokens"] else "NO",
            }
        )
    workload = make_workload(args.workload, MODEL_CONFIGS[args.model]["vocab_size"], args.scale)
    print(
        f"model {args.model}, workload {args.workload} x{args.scale} ({len(workload.requests)} requests, "
        f"{workload.num_generated_tokens} generated tokens), {os.cpu_count()} CPUs, torch {torch.__version__}\n"
    )
    columns = [(key, key) for key in rows[0]]
    print(markdown_table(rows, columns))


if __name__ == "__main__":
    main()
