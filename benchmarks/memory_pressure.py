"""The `memory-pressure` workload of benchmarks/throughput.py: recompute vs CPU offload (issue 9).

    python benchmarks/throughput.py --workloads memory-pressure [--models small] [--scale 1.0] [--page-size 32]

32 requests (x `--scale`), prompts uniform in [128, 512], 256 new tokens each, through `transformers_cb`
with a device KV cache of about a quarter of the pages they need at full length (`--num-blocks` overrides;
never below the largest request + 1). Engines:
    recompute  preempted requests drop their KV and recompute prompt + generated tokens (cpu_offload_space=0)
    offload    preempted requests swap to the host tier and back (cpu_offload_space=None: as much as the
               work can use, capped by 0.8 x available RAM)
    limit      the forward passes alone for the same work with no preemption (common.LimitEngine)
Reported per engine: wall time, preemptions, recomputed prefill tokens (KV tokens dropped by preemption),
pages swapped out / in and their volume, and the ratio to the limit. The two CB engines' outputs must be
identical (greedy); a difference is reported as an error.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import traceback
from typing import Any

import common

NAME = "memory-pressure"
DEFAULT_PAGE_SIZE = 32


def make_workload(vocab_size: int, scale: float = 1.0, seed: int = 0) -> common.Workload:
    rng = random.Random(f"{NAME}/{seed}")
    n = max(1, round(32 * scale))
    requests = [
        common.Request(
            [rng.randrange(common.FIRST_PROMPT_TOKEN, vocab_size) for _ in range(rng.randint(128, 512))], 256
        )
        for _ in range(n)
    ]
    return common.Workload(NAME, requests, description="prompts uniform in [128, 512], max_new_tokens 256")


def pressure_num_blocks(workload: common.Workload, page_size: int) -> int:
    """About a quarter of the pages the workload needs at full length, never below the largest request + 1."""
    pages = [math.ceil((len(r.prompt) + r.max_new_tokens) / page_size) for r in workload.requests]
    return max(max(pages) + 1, math.ceil(sum(pages) / 4))


def run_ours(model, workload: common.Workload, cb_kwargs: dict[str, Any]) -> tuple[common.RunResult, dict]:
    """`generate_batch` under `cb_kwargs`; returns the result and the engine's preemption / swap counters."""
    from transformers_cb.memory.host_cache import host_page_bytes

    ordered, wall, engine = common.generate_batch_on_paged_sdpa(model, workload, cb_kwargs)
    offload = engine.offload
    page_bytes = host_page_bytes(engine.cache)  # one page in every KV group, as the host tier stores it
    counters = {
        "preemptions": engine.scheduler.num_preemptions,
        "recomputed": engine.scheduler.recomputed.total,
        "swap_out_pages": 0 if offload is None else offload.swap_out_pages,
        "swap_in_pages": 0 if offload is None else offload.swap_in_pages,
        "swap_mib": 0.0
        if offload is None
        else (offload.swap_out_pages + offload.swap_in_pages) * page_bytes / 2**20,
        "host_pages": 0 if offload is None else offload.host.num_pages,
        "forwarded": engine.counters.prefill_tokens + engine.counters.decode_tokens,
    }
    result = common.RunResult("ours", ordered, wall, counters["forwarded"], True)
    return result, counters


def run(args: argparse.Namespace, log) -> list[dict[str, Any]]:
    """Every model of `args.models` through recompute, offload and the limit; prints the table, returns rows."""
    page_size = args.page_size or DEFAULT_PAGE_SIZE
    rows: list[dict[str, Any]] = []
    for model_name in args.models:
        model = common.build_model(model_name, seed=args.seed)
        workload = make_workload(model.config.vocab_size, args.scale, args.seed)
        num_blocks = args.num_blocks or pressure_num_blocks(workload, page_size)
        need = sum(math.ceil((len(r.prompt) + r.max_new_tokens) / page_size) for r in workload.requests)
        log(
            f"== {NAME} / {model_name}: {len(workload.requests)} requests, {workload.num_prompt_tokens} prompt "
            f"tokens, device cache {num_blocks} pages of {page_size} ({num_blocks / need:.0%} of {need} needed)"
        )
        base = {"page_size": page_size, "num_blocks": num_blocks}
        if args.max_batch_tokens:
            base["max_batch_tokens"] = args.max_batch_tokens
        warm = common.make_warmup_workload(model.config.vocab_size)
        run_ours(model, warm, {**base, "cpu_offload_space": None})
        results: dict[str, tuple[common.RunResult, dict]] = {}
        for name, offload_space in (("recompute", 0.0), ("offload", None)):
            if args.wait_quiet > 0:
                common.wait_for_quiet_cpu(args.quiet_load, args.wait_quiet)
            try:
                results[name] = run_ours(model, workload, {**base, "cpu_offload_space": offload_space})
            except Exception:  # noqa: BLE001 - reported in the table
                log(f"   {name} CRASHED:\n{traceback.format_exc(limit=8)}")
                continue
            log(f"   {name}: {results[name][0].wall_s:.2f}s {results[name][1]}")
        limit = common.LimitEngine(repeats=args.limit_repeats).run(model, workload)
        log(f"   limit: {limit.wall_s:.2f}s")
        same = None
        if len(results) == 2:
            same = results["recompute"][0].outputs == results["offload"][0].outputs
        for name, (result, counters) in results.items():
            rows.append(
                {
                    "model": model_name,
                    "workload": NAME,
                    "engine": name,
                    "wall_s": round(result.wall_s, 2),
                    "x_limit": round(result.wall_s / limit.wall_s, 2),
                    "preemptions": counters["preemptions"],
                    "recomputed_tokens": counters["recomputed"],
                    "swap_out_pages": counters["swap_out_pages"],
                    "swap_in_pages": counters["swap_in_pages"],
                    "swap_mib": round(counters["swap_mib"], 1),
                    "errors": "" if same in (None, True) else "outputs differ between recompute and offload",
                }
            )
        rows.append(
            {
                "model": model_name,
                "workload": NAME,
                "engine": "limit",
                "wall_s": round(limit.wall_s, 2),
                "x_limit": 1.0,
            }
        )
        if len(results) == 2:
            ratio = results["recompute"][0].wall_s / results["offload"][0].wall_s
            log(f"   offload is {ratio:.2f}x as fast as recompute; identical outputs: {same}")
    columns = [
        ("model", "model"),
        ("engine", "engine"),
        ("wall_s", "wall s"),
        ("x_limit", "x limit"),
        ("preemptions", "preemptions"),
        ("recomputed_tokens", "recomputed tokens"),
        ("swap_out_pages", "pages out"),
        ("swap_in_pages", "pages in"),
        ("swap_mib", "swap MiB"),
        ("errors", "errors"),
    ]
    print(common.markdown_table(rows, columns))
    sys.stdout.flush()
    return rows
