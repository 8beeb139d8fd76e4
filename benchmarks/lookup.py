"""The `lookup` workload of benchmarks/throughput.py: speculative decoding by prompt lookup, where it pays and
where it must not cost.

    python benchmarks/throughput.py --workloads lookup [--models tiny|smollm2] [--scale 1.0] [--threads 1]

Input-grounded generation: the output repeats spans of the prompt (rewrite, extract, summarize a given text).
  - `--models smollm2` (the real model, docs/real_model.md): "repeat / rewrite this passage" chat prompts over
    the passages of benchmarks/real_prompts.py;
  - any other model name: a tiny Llama (2 layers, 64 wide, 64 tokens) trained on the fly, a few hundred steps, to
    continue a sequence by copying it (an induction-head copier), on prompts of a random text, a separator and
    the text's first tokens: its greedy output copies the text again and again.
Engines, side by side in one process, greedy. The copy model has no eos (every request generates its
max_new_tokens); the real model stops at its end-of-turn token (`<|im_end|>`), as a client would: past it the
model, whose answer is over, makes up a new conversation, which is not input-grounded and not what a rewrite
or an extraction request wants. Every engine stops at the same token, so outputs still compare token for token.
    ours            generate_batch, no speculation
    ours-lookup     generate_batch with prompt_lookup_num_tokens=K (per-request back-off on)
    static-lookup   model.generate() one request at a time (transformers' assisted generation takes batch size
                    1) with prompt_lookup_num_tokens=K
    vllm            vLLM in its own venv (`--vllm-python` or $VLLM_PYTHON; benchmarks/vllm_engine.py), no speculation
    vllm-ngram      the same with vLLM's n-gram speculation, ours' K and n-gram sizes (`num_speculative_tokens`=K,
                    `prompt_lookup_max`=2, `prompt_lookup_min`=2)
The vLLM engines stop at the same token (`stop_token_ids`, eos ignored otherwise); each runs in a worker
process started once per model (its startup not timed) and stopped (SIGSTOP) between its own runs, so that its
idle polling does not load the other engines' runs; both are shut down before the next model.
Then the random-token checks (nothing to copy) through ours and ours-lookup, where the back-off must keep
speculation's cost under 5 %: benchmarks' tiny random model on random prompts and, for a real model, the model
itself on random tokens of its vocabulary (eos off).
Reported: wall time, tokens/s, the ratio to ours, acceptance rate and tokens per verification step (vLLM's from
its speculation counters), whether the outputs equal ours token for token, and the share of tokens up to the
first difference (vLLM's kernels round differently from transformers': a greedy tie broken otherwise changes
the rest of a request).
"""

from __future__ import annotations

import random
import time
from typing import Any

import common
import torch

NAME = "lookup"
LOOKUP_TOKENS = 8
MAX_NEW_TOKENS = 96
COPY_VOCAB = 64
SEPARATOR = 2
QUICK_RUNS = 5  # timed runs a round for a run under a second
# ours' n-gram sizes for prompt lookup: transformers' default max_matching_ngram_size and ours' shortest match.
LOOKUP_MAX_NGRAM = 2
LOOKUP_MIN_NGRAM = 2
# vLLM's engines of this workload: name -> its speculative_config (None: no speculation).
VLLM_ENGINES = {
    "vllm": None,
    "vllm-ngram": {
        "method": "ngram",
        "num_speculative_tokens": LOOKUP_TOKENS,
        "prompt_lookup_max": LOOKUP_MAX_NGRAM,
        "prompt_lookup_min": LOOKUP_MIN_NGRAM,
    },
}
VLLM_KV_CACHE_GB = 1  # per worker; ample for these workloads (two workers run at once)


def train_copy_model(seed: int = 0, steps: int = 600, log=print):
    """A 2-layer Llama that learned to continue a sequence by copying its earlier occurrence."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        # Heads of 32, not 64 / 4: vLLM's CPU attention takes head sizes from 32 up ("Unsupported CPU attention
        # configuration: head_dim=16"), and the copy model runs in vLLM too.
        head_dim=32,
        vocab_size=COPY_VOCAB,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=None,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = random.Random(seed)
    started = time.perf_counter()
    for step in range(steps):
        batch = []
        for _ in range(32):
            text = [rng.randrange(3, COPY_VOCAB) for _ in range(rng.randint(8, 32))]
            sequence = text + [SEPARATOR]
            while len(sequence) < 128:
                sequence += text
            batch.append(sequence[:128])
        ids = torch.tensor(batch)
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 100 == 0 or step == steps - 1:
            log(f"   copy model step {step}: loss {loss.item():.3f}")
    log(f"   copy model trained in {time.perf_counter() - started:.1f}s")
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.generation_config.bos_token_id = None
    return model


def copy_prompts(count: int, seed: int) -> list[list[int]]:
    """A random text (24-64 tokens), the separator, the text's first 4 tokens: the copy continues from there."""
    rng = random.Random(f"lookup/{seed}")
    prompts = []
    for _ in range(count):
        text = [rng.randrange(3, COPY_VOCAB) for _ in range(rng.randint(24, 64))]
        prompts.append(text + [SEPARATOR] + text[:4])
    return prompts


def real_prompts(tokenizer: Any, count: int, seed: int) -> list[list[int]]:
    import real_prompts as real

    rng = random.Random(f"lookup/{seed}")
    asks = (
        "Repeat the following text word for word:",
        "Rewrite the following text, keeping its wording:",
        "Copy out the key sentences of this text:",
    )
    prompts = []
    for i in range(count):
        passage = real.PASSAGES[rng.randrange(len(real.PASSAGES))]
        prompts.append(real._chat(tokenizer, f"{asks[i % len(asks)]}\n\n{passage}"))
    return prompts


def _ours(
    model, prompts, max_new: int, lookup: int | None, eos: int | None = None
) -> tuple[float, list[list[int]], dict[str, float]]:
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=eos)
    kwargs = {"prompt_lookup_num_tokens": lookup} if lookup else {}
    started = time.perf_counter()
    outputs = model.generate_batch(prompts, config, progress_bar=False, **kwargs)
    wall = time.perf_counter() - started
    ordered = [outputs[f"req_{i}"] for i in range(len(prompts))]
    drafted = sum(o.draft_tokens for o in ordered)
    accepted = sum(o.accepted_draft_tokens for o in ordered)
    produced = sum(len(o.generated_tokens) for o in ordered)
    steps = produced - accepted
    stats = {
        "acceptance": accepted / drafted if drafted else 0.0,
        "tokens_per_step": produced / steps if steps else 0.0,
    }
    return wall, [list(o.generated_tokens) for o in ordered], stats


def _static_lookup(
    model, prompts, max_new: int, lookup: int, eos: int | None = None
) -> tuple[float, list[list[int]], dict[str, float]]:
    started = time.perf_counter()
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new,
                do_sample=False,
                prompt_lookup_num_tokens=lookup,
                eos_token_id=eos,
                pad_token_id=0 if eos is None else eos,
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return time.perf_counter() - started, outputs, {}


def _vllm(runner, prompts, max_new: int, lookup: None, eos: int | None = None):
    """One timed run of a vLLM engine (its speculation fixed at its start), the worker stopped after it."""
    engine, model = runner
    stop = [eos] if eos is not None else None
    reply = engine.generate(model, prompts, [max_new] * len(prompts), stop)
    engine.pause()
    outputs = reply["outputs"]
    stats: dict[str, float] = {}
    counts = reply.get("speculation")
    if counts:
        produced = sum(len(o) for o in outputs)
        accepted = counts["accepted_tokens"]
        steps = produced - accepted
        stats = {
            "acceptance": accepted / counts["draft_tokens"] if counts["draft_tokens"] else 0.0,
            "tokens_per_step": produced / steps if steps > 0 else 0.0,
        }
    return reply["wall_s"], outputs, stats


def _start_vllm(args: Any, model, prompts, eos: int | None, log) -> dict[str, Any]:
    """vLLM's engines for `model`, started, warmed up on the workload (untimed) and paused; {} without vLLM."""
    import vllm_engine

    python = getattr(args, "vllm_python", None)
    engines: dict[str, Any] = {}
    try:
        for name, speculative in VLLM_ENGINES.items():
            engine = vllm_engine.VllmEngine(
                python,
                dtype=getattr(args, "dtype", "float32"),
                threads=torch.get_num_threads(),
                speculative_config=speculative,
                log_stats=speculative is not None,
                kv_cache_gb=VLLM_KV_CACHE_GB,
            )
            engine.name = name
            engines[name] = engine
            engine.start(model)
            log(f"   {name}: vLLM {engine.version} started in {engine.startup_s:.1f}s (not timed)")
            # vLLM's first generate pays one-time costs (seconds, against a tenth of that after): warm up on
            # the workload itself.
            _vllm((engine, model), prompts, MAX_NEW_TOKENS, None, eos)
    except BaseException:
        for engine in engines.values():
            engine.close()
        raise
    return engines


def run(args: Any, log=print) -> list[dict[str, Any]]:
    """Run the workload for each of `args.models` and print its table."""
    import real_prompts as real
    import vllm_engine

    import transformers_cb  # noqa: F401  (patches PreTrainedModel.generate_batch: ours, not transformers')

    vllm_why = vllm_engine.vllm_unavailable(getattr(args, "vllm_python", None))
    if vllm_why is not None:
        log(f"   skipping vllm, vllm-ngram: {vllm_why}")
    vllm_notes: list[str] = []
    rows: list[dict[str, Any]] = []
    for model_name in args.models:
        if real.is_real(model_name):
            model, tokenizer = real.build_model(model_name)
            model.generation_config.eos_token_id = None
            prompts = real_prompts(tokenizer, max(2, round(8 * args.scale)), args.seed)
            label = model_name
            eos = tokenizer.eos_token_id  # the end of the assistant's turn: see the module docstring
        else:
            model = train_copy_model(args.seed, log=log)
            prompts = copy_prompts(max(2, round(16 * args.scale)), args.seed)
            label = "copy (trained)"
            eos = None
        # The random-token checks (nothing to copy, every request runs its max_new_tokens): benchmarks' random
        # "tiny" model on random prompts; for a real model also the model itself on random tokens of its
        # vocabulary (a compute-bound model, where every rejected draft position costs).
        random_model = common.build_model("tiny", seed=args.seed)
        vocab = random_model.config.vocab_size
        rng = random.Random(f"lookup-random/{args.seed}")
        random_inputs = [[rng.randrange(3, vocab) for _ in range(rng.randint(16, 64))] for _ in prompts]
        _ours(random_model, random_inputs[:2], 8, LOOKUP_TOKENS)
        # Warm both paths up (first-call costs), outside the timings.
        _ours(model, prompts[:2], 8, None, eos)
        _ours(model, prompts[:2], 8, LOOKUP_TOKENS, eos)
        grounded, tiny_random = "input-grounded", "random (tiny random model)"
        runs = [  # (workload, engine), how, model, prompts, lookup tokens, eos
            ((grounded, "ours"), _ours, model, prompts, None, eos),
            ((grounded, "ours-lookup"), _ours, model, prompts, LOOKUP_TOKENS, eos),
            ((grounded, "static-lookup"), _static_lookup, model, prompts, LOOKUP_TOKENS, eos),
            ((tiny_random, "ours"), _ours, random_model, random_inputs, None, None),
            ((tiny_random, "ours-lookup"), _ours, random_model, random_inputs, LOOKUP_TOKENS, None),
        ]
        if real.is_real(model_name):
            # Token ids from 100 up: SmolLM2's special tokens (chat markers, eos) are the first ids.
            real_vocab = model.config.vocab_size
            real_random = [
                [rng.randrange(100, real_vocab) for _ in range(rng.randint(16, 64))] for _ in prompts
            ]
            runs += [
                (("random tokens", "ours"), _ours, model, real_random, None, None),
                (("random tokens", "ours-lookup"), _ours, model, real_random, LOOKUP_TOKENS, None),
            ]
        vllm_engines = {} if vllm_why is not None else _start_vllm(args, model, prompts, eos, log)
        for i, (name, engine) in enumerate(vllm_engines.items()):  # after static-lookup
            runs.insert(3 + i, ((grounded, name), _vllm, (engine, model), prompts, None, eos))
            vllm_notes.append(f"{label} {name}: vLLM {engine.version}, startup {engine.startup_s:.0f} s")
        # Repeats go round the engines (not engine after engine), so that a load change on the shared
        # machine hits every engine alike; the fastest run of each is kept. A run under a second (the tiny
        # model's) is timed QUICK_RUNS times a round: a few milliseconds of noise are several percent there.
        results: dict[tuple[str, str], Any] = {}
        try:
            for _ in range(max(1, args.repeats)):
                for key, fn, runner, inputs, lookup, stop in runs:
                    for _ in range(QUICK_RUNS if key in results and results[key][0] < 1.0 else 1):
                        result = fn(runner, inputs, MAX_NEW_TOKENS, lookup, stop)
                        if key not in results or result[0] < results[key][0]:
                            results[key] = result
                    log(f"   {label}/{key[0]}/{key[1]}: {result[0]:.2f}s")
        finally:
            for engine in vllm_engines.values():
                engine.close()
        for (workload, engine), (wall, outputs, stats) in results.items():
            base_wall, base_outputs, _ = results[(workload, "ours")]
            tokens = sum(len(o) for o in outputs)
            same = sum(a == b for a, b in zip(outputs, base_outputs, strict=True))
            agreeing = sum(_common_prefix(a, b) for a, b in zip(outputs, base_outputs, strict=True))
            compared = sum(max(len(a), len(b)) for a, b in zip(outputs, base_outputs, strict=True))
            rows.append(
                {
                    "model": label,
                    "workload": workload,
                    "engine": engine,
                    "requests": len(outputs),
                    "gen_tokens": tokens,
                    "wall_s": wall,
                    "gen_tok_s": tokens / wall,
                    "vs_ours": base_wall / wall,
                    "acceptance": stats.get("acceptance"),
                    "tokens_per_step": stats.get("tokens_per_step"),
                    "identical": f"{same}/{len(outputs)}",
                    "outputs_sha": common.outputs_digest(outputs),
                    "same_tokens": agreeing / compared if compared else 1.0,
                }
            )
    columns = [
        ("model", "model"),
        ("workload", "workload"),
        ("engine", "engine"),
        ("requests", "reqs"),
        ("gen_tokens", "gen tok"),
        ("wall_s", "wall s"),
        ("gen_tok_s", "gen tok/s"),
        ("vs_ours", "speedup vs ours"),
        ("acceptance", "acceptance"),
        ("tokens_per_step", "tok / verify step"),
        ("identical", "= ours (requests)"),
        ("same_tokens", "= ours (tokens before the first difference)"),
    ]
    print()
    print(
        f"lookup: prompt_lookup_num_tokens={LOOKUP_TOKENS}, max_new_tokens={MAX_NEW_TOKENS}, greedy, threads={torch.get_num_threads()}"
    )
    print(common.markdown_table(rows, columns))
    if vllm_why is not None:
        print(f"vllm, vllm-ngram: not run ({vllm_why}; see --vllm-python)")
    else:
        print(
            "vllm, vllm-ngram (input-grounded rows only): " + "; ".join(vllm_notes) + " (startups not timed)"
        )
    return rows


def _common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    count = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        count += 1
    return count
