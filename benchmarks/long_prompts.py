"""The `long-prompts` workload of benchmarks/throughput.py: long prompts on a model with rope scaling (issue 48).

    python benchmarks/throughput.py --workloads long-prompts [--scale 1.0] [--page-size 32] [--vllm-python PY]

8 requests (x `--scale`), prompts uniform in [8192, 32768] tokens, 4 new tokens each, on `mini-longrope`: the
`mini` Llama (4 layers, 256 wide) with LongRoPE (`original_max_position_embeddings` 2048, 32768 positions),
so every prompt runs past the native length on the long factors, each request's own set
(runner/request_rotary.py). Engines:
    ours     `generate_batch` (chunked prefill at the default token budget, prefix sharing on)
    vllm     vLLM in its own venv (`--vllm-python`), max_model_len 32768, when it runs there
Reported per engine: wall time, prompt tokens per second, peak KV bytes (ours: the most pages held at once
in any step x one page's bytes, and the allocated cache), and agreement with `generate()` run on each of
the first `--ref-requests` prompts alone (a request that differs is an error; vLLM's is reported, not
required: its kernels sum in another order).

`--scale` below 1 shortens the prompts too, never to the native length (a smoke run: `--scale 0.05` is one
request of 2112 tokens).
"""

from __future__ import annotations

import argparse
import random
import sys
import traceback
from typing import Any

import common

NAME = "long-prompts"
MODEL = "mini-longrope"
NATIVE = 2048  # original_max_position_embeddings: LongRoPE switches to its long factors past it
POSITIONS = 32768
MIN_PROMPT, MAX_PROMPT = 8192, 32768
MAX_NEW_TOKENS = 4
REQUESTS = 8


def longrope_config() -> dict[str, Any]:
    """`mini` with LongRoPE: short factors 1, long factors growing from 1 to 16 over the head's frequencies."""
    config = dict(common.MODEL_CONFIGS["mini"])
    half = config["hidden_size"] // config["num_attention_heads"] // 2
    config["max_position_embeddings"] = POSITIONS
    config["rope_parameters"] = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0] * half,
        "long_factor": [16.0 ** (i / (half - 1)) for i in range(half)],
        "original_max_position_embeddings": NATIVE,
    }
    return config


def build_model(seed: int = 0):
    common.MODEL_CONFIGS.setdefault(MODEL, longrope_config())
    return common.build_model(MODEL, seed=seed)


def make_workload(vocab_size: int, scale: float = 1.0, seed: int = 0) -> common.Workload:
    """`REQUESTS` x scale requests (at least one); below scale 1 the prompts shrink by it too, never to the
    native length: every prompt runs on the long factors."""
    rng = random.Random(f"{NAME}/{seed}")
    n = max(1, round(REQUESTS * scale))
    shrink = min(1.0, scale)
    low = max(NATIVE + 64, int(MIN_PROMPT * shrink))
    high = max(low, int(MAX_PROMPT * shrink))
    requests = [
        common.Request(
            [rng.randrange(common.FIRST_PROMPT_TOKEN, vocab_size) for _ in range(rng.randint(low, high))],
            MAX_NEW_TOKENS,
        )
        for _ in range(n)
    ]
    return common.Workload(
        NAME, requests, description=f"prompts uniform in [{low}, {high}], {MAX_NEW_TOKENS} new"
    )


def run_ours(model, workload: common.Workload, cb_kwargs: dict[str, Any]) -> tuple[common.RunResult, dict]:
    """`generate_batch`; the result and the cache's peak (pages held after any step, page bytes, allocated)."""
    peak = [0]

    def held_bytes(engine) -> int:
        layout = engine.cache.layout
        return sum(p.num_used_pages * layout.group_page_bytes(g) for g, p in enumerate(engine.pages.pools))

    def after_step(engine, first: bool) -> None:
        peak[0] = max(0 if first else peak[0], held_bytes(engine))

    ordered, wall, engine = common.generate_batch_on_paged_sdpa(model, workload, cb_kwargs, after_step)
    layout = engine.cache.layout
    allocated = sum(p.num_pages * layout.group_page_bytes(g) for g, p in enumerate(engine.pages.pools))
    memory = {"peak_kv_bytes": peak[0], "allocated_kv_bytes": allocated}
    forwarded = engine.counters.prefill_tokens + engine.counters.decode_tokens
    return common.RunResult("ours", ordered, wall, forwarded, True), memory


def references(model, workload: common.Workload, count: int) -> list[list[int]]:
    """`generate()` on each of the first `count` prompts alone (greedy, eos off)."""
    import torch

    out = []
    for request in workload.requests[:count]:
        ids = torch.tensor([request.prompt])
        with torch.inference_mode():
            tokens = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                generation_config=common.greedy_generation_config(request.max_new_tokens),
            )
        out.append(tokens[0, ids.shape[1] :].tolist())
    return out


def agreement(outputs: list[list[int]], expected: list[list[int]]) -> str:
    """`k/n` requests equal to `generate()`, with the first that differs."""
    same = [list(o) == e for o, e in zip(outputs, expected, strict=False)]
    text = f"{sum(same)}/{len(same)}"
    if not all(same):
        text += f" (req_{same.index(False)} differs)"
    return text


def run(args: argparse.Namespace, log) -> list[dict[str, Any]]:
    """Ours (and vLLM where it runs) on the workload; prints the table, returns its rows."""
    model = build_model(args.seed)
    workload = make_workload(model.config.vocab_size, args.scale, args.seed)
    lengths = [len(r.prompt) for r in workload.requests]
    log(f"== {NAME} / {MODEL}: {len(lengths)} requests, prompts {min(lengths)}-{max(lengths)} tokens")
    cb_kwargs: dict[str, Any] = {"page_size": args.page_size or 32}
    if args.max_batch_tokens:
        cb_kwargs["max_batch_tokens"] = args.max_batch_tokens
    expected = references(model, workload, args.ref_requests)
    rows: list[dict[str, Any]] = []
    if args.wait_quiet > 0:
        common.wait_for_quiet_cpu(args.quiet_load, args.wait_quiet)
    try:
        result, memory = run_ours(model, workload, cb_kwargs)
        agree = agreement(result.outputs, expected)
        rows.append(_row("ours", workload, result.wall_s, memory, agree, all_equal="differs" not in agree))
        log(f"   ours: {result.wall_s:.2f}s {memory} generate(): {agree}")
    except Exception:  # noqa: BLE001 - reported in the table
        log(f"   ours CRASHED:\n{traceback.format_exc(limit=8)}")
    rows.extend(_vllm_rows(args, model, workload, expected, log))
    columns = [
        ("engine", "engine"),
        ("wall_s", "wall s"),
        ("prompt_tok_s", "prompt tok/s"),
        ("peak_kv_mib", "peak KV MiB"),
        ("allocated_kv_mib", "allocated KV MiB"),
        ("generate_agreement", "= generate()"),
        ("errors", "errors"),
    ]
    print(common.markdown_table(rows, columns))
    sys.stdout.flush()
    return rows


def _row(
    engine: str, workload: common.Workload, wall: float, memory: dict, agree: str, all_equal: bool
) -> dict[str, Any]:
    mib = 2**20
    return {
        "model": MODEL,
        "workload": NAME,
        "engine": engine,
        "wall_s": round(wall, 2),
        "prompt_tok_s": round(workload.num_prompt_tokens / wall),
        "peak_kv_mib": round(memory["peak_kv_bytes"] / mib, 1) if "peak_kv_bytes" in memory else "-",
        "allocated_kv_mib": round(memory["allocated_kv_bytes"] / mib, 1)
        if "allocated_kv_bytes" in memory
        else "-",
        "generate_agreement": agree,
        "errors": "" if all_equal or engine != "ours" else "differs from generate()",
    }


def _vllm_rows(args: argparse.Namespace, model, workload: common.Workload, expected, log) -> list[dict]:
    """vLLM's row where `--vllm-python` runs it (its KV is its own pool: not measured here)."""
    import vllm_engine

    why = vllm_engine.vllm_unavailable(args.vllm_python)
    if why is not None:
        log(f"   vllm skipped: {why}")
        return []
    engine = vllm_engine.VllmEngine(args.vllm_python, dtype=args.dtype, max_model_len=POSITIONS)
    try:
        engine.warmup(model, common.make_warmup_workload(model.config.vocab_size))
        result = engine.run(model, workload)
    except Exception:  # noqa: BLE001 - reported in the table
        log(f"   vllm CRASHED:\n{traceback.format_exc(limit=8)}")
        return []
    finally:
        engine.close()
    return [_row("vllm", workload, result.wall_s, {}, agreement(result.outputs, expected), all_equal=True)]
