"""vLLM's side of the `vllm` engine of throughput.py: runs under vLLM's own Python (its own venv).

    /path/to/vllm-venv/bin/python benchmarks/vllm_worker.py MODEL_DIR [--dtype float32] [--max-model-len 2048]
        [--speculative-config '{"method": "ngram", "num_speculative_tokens": 8, ...}'] [--log-stats]

Loads `MODEL_DIR` (a model saved by the benchmark) once, then prints one JSON line
`@@tcb-vllm {"ready": true, "startup_s": ..., "version": ...}`. Afterwards each line read from stdin is a workload
`{"prompts": [[ids...]...], "max_new_tokens": [...]}` (optionally `"stop_token_ids": [...]`, every request
stopping at any of them, the stop token kept in its output) and gets one JSON line back:
`{"outputs": [[ids...]...], "wall_s": ...}`, greedy, EOS ignored, token ids in and out (no tokenizer).
With `--log-stats` and a speculative config the reply also has `"speculation": {"drafts", "draft_tokens",
"accepted_tokens"}`, vLLM's counters over that call. Only `llm.generate` is timed. Every other line vLLM prints
goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

PREFIX = "@@tcb-vllm "  # marks the reply lines (vllm_engine.py skips any other line)
# vLLM's counters of speculative decoding (vllm.v1.spec_decode.metrics), read through `LLM.get_metrics()`.
SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
}


def speculation_counts(llm) -> dict[str, int]:
    """vLLM's cumulative speculation counters (empty without a speculative config or with stats off)."""
    counts: dict[str, int] = {}
    for metric in llm.get_metrics():
        key = SPEC_COUNTERS.get(metric.name)
        if key is not None:
            counts[key] = counts.get(key, 0) + int(metric.value)
    return counts


OPENMP_LIBS = ("libiomp5", "libgomp", "libomp")  # benchmarks/common.py OPENMP_LIBS (not imported here)


def openmp_runtimes() -> list[str]:
    """The OpenMP runtimes loaded in this process and in the processes vLLM started (its engine core runs
    the forward), from their memory maps."""
    pids = [str(os.getpid())]
    try:
        with open(f"/proc/{os.getpid()}/task/{os.getpid()}/children") as handle:
            pids += handle.read().split()
    except OSError:
        pass
    found: set[str] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as handle:
                maps = handle.read()
        except OSError:
            continue
        found.update(lib for lib in OPENMP_LIBS if f"/{lib}" in maps)
    return sorted(found)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("model_dir")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument(
        "--speculative-config",
        type=json.loads,
        default=None,
        help="vLLM's speculative_config as JSON (e.g. n-gram speculation)",
    )
    p.add_argument("--log-stats", action="store_true", help="keep vLLM's stats on (its speculation counters)")
    args = p.parse_args()
    # vLLM's own output (its engine-core process included, which inherits fd 1) goes to stderr; the replies
    # keep a private copy of the original stdout.
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    start = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=args.model_dir,
        skip_tokenizer_init=True,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        seed=0,
        speculative_config=args.speculative_config,
        disable_log_stats=not args.log_stats,
    )
    counting = args.log_stats and args.speculative_config is not None
    reply.write(
        PREFIX
        + json.dumps(
            {
                "ready": True,
                "startup_s": time.perf_counter() - start,
                "version": vllm.__version__,
                "openmp": openmp_runtimes(),
            }
        )
        + "\n"
    )
    reply.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in job["prompts"]]
        stop = job.get("stop_token_ids") or None
        params = [
            SamplingParams(
                max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False, stop_token_ids=stop
            )
            for n in job["max_new_tokens"]
        ]
        before = speculation_counts(llm) if counting else {}
        # Every job starts cold, as ours does (each `generate_batch` starts with an empty prefix cache): vLLM's
        # prefix cache otherwise keeps the warm-up's and the earlier repeats' prompts (the same workload), and a
        # repeat computes only each prompt's last partial block (small mixed: 4,394 of 15,599 prompt tokens).
        # Prefixes shared within one job are still shared.
        cold = job.get("keep_prefix_cache") or llm.reset_prefix_cache()
        if not cold:
            raise RuntimeError("vLLM did not reset its prefix cache between jobs (requests still running?)")
        t0 = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        outputs = [list(result.outputs[0].token_ids) for result in results]
        answer: dict = {"outputs": outputs, "wall_s": wall}
        if counting:
            after = speculation_counts(llm)
            answer["speculation"] = {key: after[key] - before.get(key, 0) for key in after}
        reply.write(PREFIX + json.dumps(answer) + "\n")
        reply.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
