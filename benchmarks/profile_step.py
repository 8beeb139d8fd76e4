"""Where one engine step's time goes: a decode-only step and a prefill step of a benchmark model.

    python benchmarks/profile_step.py [--model small] [--rows 16] [--kv 256] [--prefill 512]
                                      [--compile-level 0] [--steps 20] [--top 25] [--no-profiler]

Builds an `Engine` on the seeded benchmark model, admits `--rows` requests with `--kv`-token prompts, and
times `--steps` decode-only steps split into their phases (schedule, pack, forward, sample, update), beside
the same model's plain forward on a `DynamicCache` of the same shape (the benchmarks' "limit"). Then prints
`torch.profiler`'s operator table of one decode step and of one `--prefill`-token prefill step. The machine
may be noisy: read the phases as shares of one run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from transformers_cb.engine.intake.submission import Submission


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small")
    p.add_argument("--rows", type=int, default=16, help="decode rows (requests)")
    p.add_argument("--kv", type=int, default=256, help="prompt tokens per request (the decode's KV length)")
    p.add_argument("--prefill", type=int, default=512, help="prompt tokens of the profiled prefill step")
    p.add_argument("--compile-level", type=int, default=0, help="default_compile_level of the engine")
    p.add_argument("--steps", type=int, default=20, help="timed decode steps")
    p.add_argument("--top", type=int, default=25, help="profiler rows printed")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--dtype", default="float32", help="float32 or bfloat16")
    p.add_argument(
        "--packed-linear",
        default="auto",
        choices=("auto", "on", "off"),
        help="ContinuousBatchingConfig.packed_linear: auto (None, the default), on (True), off (False)",
    )
    p.add_argument("--no-profiler", action="store_true", help="only the phase timings")
    p.add_argument(
        "--quantized",
        action="store_true",
        help="a real model with its GGUF kept quantized (docs/quantization.md; over lanes in bfloat16)",
    )
    p.add_argument(
        "--save-model",
        type=Path,
        default=None,
        help="save the model to this folder (for benchmarks/profile_vllm.py) and exit",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import common
    import transformers

    import transformers_cb
    from transformers_cb.engine.build import build_engine

    if args.threads:
        torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    import real_prompts

    dtype = getattr(torch, args.dtype)
    if real_prompts.is_real(args.model):
        model, _tokenizer = real_prompts.build_model(args.model, dtype=dtype)
    else:
        model = common.build_model(args.model, dtype=dtype)
    if args.quantized:
        from transformers_cb.models.gguf_weights import keep_gguf_quantized

        gguf = common.model_gguf(model)
        if gguf is None:
            raise SystemExit(f"--quantized: {args.model} keeps no GGUF (real models only)")
        report = keep_gguf_quantized(model, gguf)
        print(f"kept quantized: {len(report.quantized)} modules, {len(report.lanes)} over lanes")
    if args.save_model is not None:
        model.save_pretrained(args.save_model)
        print(f"saved {args.model} ({args.dtype}) to {args.save_model}")
        return 0
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    packed = {"auto": None, "on": True, "off": False}[args.packed_linear]
    cfg = transformers_cb.ContinuousBatchingConfig(
        default_compile_level=args.compile_level, packed_linear=packed
    )
    max_new = args.steps * 3 + 50
    workload = [args.kv + max_new] * args.rows + [args.prefill + 2]
    engine = build_engine(model, common.greedy_generation_config(max_new), cfg, workload=workload)
    phases = {"schedule": 0.0, "pack": 0.0, "forward": 0.0, "sample": 0.0, "update": 0.0}
    runner = engine.runner

    def timed(name, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            phases[name] += time.perf_counter() - t0
            return out

        return wrapper

    with (
        engine.session()
    ):  # the model as the engine runs it: paged attention, packed products, native layer ops
        engine.warmup()
        for i in range(args.rows):
            ids = torch.randint(3, vocab, (args.kv,), generator=gen).tolist()
            engine.add(
                engine.build_request(Submission(ids, f"r{i}", max_new_tokens=max_new, eos_token_id=None))
            )
        while any(not r.generated_ids for r in engine.running_requests()) or engine.num_waiting:
            engine.step()
        for _ in range(args.steps):  # warm (and compile) the decode path
            engine.step()
        engine.scheduler.schedule = timed("schedule", engine.scheduler.schedule)
        runner.packer.pack = timed("pack", runner.packer.pack)
        runner._forward = timed("forward", runner._forward)
        runner.sampler.sample = timed("sample", runner.sampler.sample)
        engine.scheduler.update = timed("update", engine.scheduler.update)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        total = (time.perf_counter() - t0) / args.steps * 1e3
        kv_len = max(r.num_tokens for r in engine.running_requests())

        # The limit: the same model's plain forward over a DynamicCache of the same shape.
        common.restore_attn_implementation(model)
        cache = transformers.DynamicCache(config=model.config)
        prompt = torch.randint(3, vocab, (args.rows, kv_len), generator=gen)
        model(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
        step_ids = torch.randint(3, vocab, (args.rows, 1), generator=gen)
        # A hybrid's state layers cannot roll back (crop): there its attention KV grows by one token a
        # step, a few percent on the limit's attention for --steps far below --kv.
        rollback = not common.is_hybrid(model.config)
        limit = float("inf")
        for _ in range(3):
            t1 = time.perf_counter()
            for _ in range(args.steps):
                model(input_ids=step_ids, past_key_values=cache, use_cache=True).logits.argmax(-1).tolist()
                if rollback:
                    cache.crop(-1)
            limit = min(limit, (time.perf_counter() - t1) / args.steps * 1e3)

    print(
        f"model {args.model} ({args.dtype}, packed products {engine.settings.step_options.packed_linear}), {args.rows} decode rows "
        f"at KV ~{kv_len}, compile level {args.compile_level}"
    )
    print(f"engine step {total:.2f} ms; limit forward {limit:.2f} ms ({total / limit:.2f}x)")
    for name, seconds in phases.items():
        ms = seconds / args.steps * 1e3
        print(f"  {name:9s} {ms:7.2f} ms  {ms / total:6.1%}")
    other = total - sum(phases.values()) / args.steps * 1e3
    print(f"  {'other':9s} {other:7.2f} ms  {other / total:6.1%}")
    if args.no_profiler:
        return 0

    from torch.profiler import ProfilerActivity, profile

    with engine.session():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            engine.step()
        print("\n== one decode step")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
        ids = torch.randint(3, vocab, (args.prefill,), generator=gen).tolist()
        engine.add(engine.build_request(Submission(ids, "prefill", max_new_tokens=1, eos_token_id=None)))
        for request in list(engine.running_requests()):
            if request.request_id != "prefill":
                engine.finish(request, transformers_cb.RequestStatus.FINISHED)
                engine.runner.release([request])
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            engine.step()
        print(f"\n== one prefill step ({args.prefill} tokens)")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
