"""vLLM's side of `profile_step.py`: torch.profiler's operator table of vLLM's decode and prefill steps.

Runs under vLLM's own Python (its venv), on a model folder saved by `profile_step.py --save-model DIR` (or
any local model folder):

    /work/venv-vllm/bin/python benchmarks/profile_vllm.py DIR [--dtype bfloat16] [--rows 16] [--kv 300]
        [--prefill 512] [--steps 10] [--top 25]

vLLM runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`: its engine core and CPU worker are not
separate processes), with its venv's libiomp5 preloaded as vLLM's CPU docs ask (the script re-executes
itself with `LD_PRELOAD` when it is missing). It adds `--rows` requests of `--kv` tokens to vLLM's
engine, steps it through their prefill, times `--steps` decode steps (`LLMEngine.step`), then profiles one
decode step and one `--prefill`-token prompt, and prints the operator tables sorted by self CPU time, as
`profile_step.py` prints ours.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--kv", type=int, default=300)
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--top", type=int, default=25)
    return p.parse_args(argv)


SITE = Path(__file__).resolve().parent / "vllm_site"  # hides PyPI's CUDA torchvision (vllm_engine.py)


def _with_iomp() -> None:
    """Re-execute with the venv's libiomp5 in LD_PRELOAD (vLLM's recommended OpenMP runtime) and
    `vllm_site` on PYTHONPATH."""
    library = Path(sys.executable).parent.parent / "lib" / "libiomp5.so"
    if os.environ.get("PYTHONPATH") != str(SITE) or (
        library.exists() and str(library) not in os.environ.get("LD_PRELOAD", "")
    ):
        env = dict(os.environ, PYTHONPATH=str(SITE))
        if library.exists():
            env["LD_PRELOAD"] = f"{library} {os.environ.get('LD_PRELOAD', '')}".strip()
        os.execve(sys.executable, [sys.executable, *sys.argv], env)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _with_iomp()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # as vllm_engine.py: vLLM 0.32 no longer guesses it
    import torch
    from torch.profiler import ProfilerActivity, profile
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=args.model_dir,
        skip_tokenizer_init=True,
        dtype=args.dtype,
        max_model_len=2048,
        seed=0,
        enable_prefix_caching=False,
    )
    gen = torch.Generator().manual_seed(0)

    def prompts(n: int, length: int) -> list[TokensPrompt]:
        return [
            TokensPrompt(prompt_token_ids=torch.randint(3, 4000, (length,), generator=gen).tolist())
            for _ in range(n)
        ]

    def run(batch: list[TokensPrompt], tokens: int) -> float:
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, detokenize=False)
        t0 = time.perf_counter()
        llm.generate(batch, params, use_tqdm=False)
        return time.perf_counter() - t0

    run(prompts(args.rows, args.kv), 4)  # warm
    # Decode steps alone: the requests added to the engine, stepped through their prefill, then timed.
    engine = llm.llm_engine
    warm_steps = args.rows * args.kv // 256 + 4  # every prefill chunk, and a few decode steps
    # tokens enough for the warm-up's decode steps too: the timed and profiled steps must all decode every row
    params = SamplingParams(
        max_tokens=warm_steps + 4 * args.steps + 8, temperature=0.0, ignore_eos=True, detokenize=False
    )
    for i, prompt in enumerate(prompts(args.rows, args.kv)):
        engine.add_request(f"d{i}", prompt, params)
    for _ in range(warm_steps):
        engine.step()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    step_ms = (time.perf_counter() - t0) / args.steps * 1e3
    print(f"vLLM {args.dtype}: {args.rows} decode rows at KV ~{args.kv}: {step_ms:.2f} ms a decode step")
    print(f"LD_PRELOAD: {os.environ.get('LD_PRELOAD', '(none)')}")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.step()
    print("\n== one decode step")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    while engine.has_unfinished_requests():
        engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run(prompts(1, args.prefill), 1)
    print(f"\n== one prefill ({args.prefill} tokens)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
