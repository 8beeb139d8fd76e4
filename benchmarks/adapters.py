"""The `adapters` workload of benchmarks/throughput.py: requests over many LoRA adapters in one batch against the
base model alone (issue 50, docs/adapters.md).

    python benchmarks/throughput.py --workloads adapters [--models tiny,small] [--scale 0.5]

64 requests (x `--scale`), random prompts of 16-64 tokens, 64 new tokens at most, greedy, through
`transformers_cb`. The model carries 8 LoRA adapters (rank 16 on every projection, seeded weights); engines,
side by side in one process:
    plain           the model before any adapter was added (the base model alone)
    base-rows       the adapted model, every request with adapter=None (the LoRA layers' base product only)
    one-adapter     every request on adapter a0 (one group: the delta added to all rows, no gather)
    mixed-8         request i on adapter a{i % 8}: eight groups in every step
Reported per engine: wall time, generated tokens, tokens/s and the ratio to plain (the cost of mixing, in one
run). The requests of mixed-8 on a0 must give what they give in one-adapter (`errors` otherwise).
"""

from __future__ import annotations

import argparse
import copy
import random
import sys
import time
from typing import Any

import common
import torch

NAME = "adapters"
MAX_NEW_TOKENS = 64
NUM_ADAPTERS = 8
RANK = 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_workload(vocab_size: int, scale: float, seed: int) -> common.Workload:
    rng = random.Random(f"{NAME}/{seed}")
    requests = [
        common.Request(
            [rng.randrange(common.FIRST_PROMPT_TOKEN, vocab_size) for _ in range(rng.randint(16, 64))],
            MAX_NEW_TOKENS,
        )
        for _ in range(max(NUM_ADAPTERS, round(64 * scale)))
    ]
    return common.Workload(NAME, requests, description="prompts uniform in [16, 64], max_new_tokens 64")


def adapted(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """A copy of `model` carrying `NUM_ADAPTERS` LoRA adapters with seeded weights (B away from zero)."""
    import peft

    model = copy.deepcopy(model)
    for i in range(NUM_ADAPTERS):
        config = peft.LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=TARGETS, init_lora_weights=False)
        model.add_adapter(config, adapter_name=f"a{i}")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)
    return model.eval()


def run_ours(
    model, workload: common.Workload, adapters: list[str | None] | None
) -> tuple[float, list[list[int]]]:
    """Wall seconds and outputs in order (`adapters` None: no `adapter=`, the plain model)."""
    from transformers_cb import ContinuousBatchingConfig

    kwargs: dict[str, Any] = {} if adapters is None else {"adapter": adapters}
    model.set_attn_implementation("paged|sdpa")
    t0 = time.perf_counter()
    outputs = model.generate_batch(
        workload.inputs,
        generation_config=common.greedy_generation_config(MAX_NEW_TOKENS),
        continuous_batching_config=ContinuousBatchingConfig(),
        progress_bar=False,
        **kwargs,
    )
    wall = time.perf_counter() - t0
    common.restore_attn_implementation(model)
    return wall, [outputs[f"req_{i}"].generated_tokens for i in range(len(workload.requests))]


def run(args: argparse.Namespace, log) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for model_name in args.models:
        plain = common.build_model(model_name, seed=args.seed)
        model = adapted(plain, args.seed)
        vocab = plain.config.vocab_size
        workload = make_workload(vocab, args.scale, args.seed)
        n = len(workload.requests)
        log(f"== {NAME} / {model_name}: {n} requests over {NUM_ADAPTERS} LoRA adapters (rank {RANK})")
        runs = {
            "plain": (plain, None),
            "base-rows": (model, [None] * n),
            "one-adapter": (model, ["a0"] * n),
            f"mixed-{NUM_ADAPTERS}": (model, [f"a{i % NUM_ADAPTERS}" for i in range(n)]),
        }
        warmup = common.make_warmup_workload(vocab)
        for engine_model, adapters in runs.values():  # first-call costs
            warm = None if adapters is None else [adapters[i % n] for i in range(len(warmup.requests))]
            run_ours(engine_model, warmup, warm)
        results: dict[str, tuple[float, list[list[int]]]] = {}
        for rep in range(args.repeats):  # interleaved, the fastest of each kept: the machine may be noisy
            for name, (engine_model, adapters) in runs.items():
                if args.wait_quiet > 0:
                    common.wait_for_quiet_cpu(args.quiet_load, args.wait_quiet)
                result = run_ours(engine_model, workload, adapters)
                log(f"   {name} run {rep + 1}: {result[0]:.2f}s")
                if name not in results or result[0] < results[name][0]:
                    results[name] = result
        base_wall, base_out = results["plain"]
        base_rate = sum(map(len, base_out)) / base_wall
        for name, (wall, outputs) in results.items():
            tokens = sum(map(len, outputs))
            row = {
                "model": model_name,
                "engine": name,
                "requests": n,
                "gen_tokens": tokens,
                "wall_s": round(wall, 2),
                "gen_tok_s": round(tokens / wall, 1),
                "x_plain_tok_s": round(tokens / wall / base_rate, 2),
            }
            if name.startswith("mixed"):
                one = results["one-adapter"][1]
                same = [outputs[i] == one[i] for i in range(0, n, NUM_ADAPTERS)]
                row["errors"] = "" if all(same) else f"{same.count(False)} a0 outputs differ from one-adapter"
            if name == "base-rows":
                same = [outputs[i] == base_out[i] for i in range(n)]
                row["errors"] = "" if all(same) else f"{same.count(False)} outputs differ from plain"
            rows.append(row)
        del model, plain
    columns = [
        ("model", "model"),
        ("engine", "engine"),
        ("requests", "reqs"),
        ("gen_tokens", "gen tok"),
        ("wall_s", "wall s"),
        ("gen_tok_s", "gen tok/s"),
        ("x_plain_tok_s", "tok/s vs plain"),
        ("errors", "errors"),
    ]
    print(common.markdown_table(rows, columns))
    sys.stdout.flush()
    return rows
