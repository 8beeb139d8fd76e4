"""vLLM's side of the `vllm` engine of throughput.py: runs under vLLM's own Python (its own venv).

    /path/to/vllm-venv/bin/python benchmarks/vllm_worker.py MODEL_DIR [--dtype float32] [--max-model-len 2048]

Loads `MODEL_DIR` (a model saved by the benchmark) once, then prints one JSON line
`@@tcb-vllm {"ready": true, "startup_s": ...}`. Afterwards each line read from stdin is a workload
`{"prompts": [[ids...]...], "max_new_tokens": [...]}` and gets one JSON line back:
`{"outputs": [[ids...]...], "wall_s": ...}`, greedy, EOS ignored, token ids in and out (no tokenizer).
Only `llm.generate` is timed. Every other line vLLM prints goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

PREFIX = "@@tcb-vllm "  # marks the reply lines (vllm_engine.py skips any other line)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("model_dir")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=256)
    args = p.parse_args()
    # vLLM's own output (its engine-core process included, which inherits fd 1) goes to stderr; the replies
    # keep a private copy of the original stdout.
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    start = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=args.model_dir,
        skip_tokenizer_init=True,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        seed=0,
    )
    reply.write(PREFIX + json.dumps({"ready": True, "startup_s": time.perf_counter() - start}) + "\n")
    reply.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in job["prompts"]]
        params = [
            SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)
            for n in job["max_new_tokens"]
        ]
        t0 = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        outputs = [list(result.outputs[0].token_ids) for result in results]
        reply.write(PREFIX + json.dumps({"outputs": outputs, "wall_s": wall}) + "\n")
        reply.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
