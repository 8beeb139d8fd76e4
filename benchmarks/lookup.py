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
Then the random-token checks (nothing to copy) through ours and ours-lookup, where the back-off must keep
speculation's cost under 5 %: benchmarks' tiny random model on random prompts and, for a real model, the model
itself on random tokens of its vocabulary (eos off).
Reported: wall time, tokens/s, the ratio to ours, acceptance rate and tokens per verification step, and whether
the outputs equal ours token for token.
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


def run(args: Any, log=print) -> list[dict[str, Any]]:
    """Run the workload for each of `args.models` and print its table."""
    import real_prompts as real

    import transformers_cb  # noqa: F401  (patches PreTrainedModel.generate_batch: ours, not transformers')

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
        # Repeats go round the engines (not engine after engine), so that a load change on the shared
        # machine hits every engine alike; the fastest run of each is kept. A run under a second (the tiny
        # model's) is timed QUICK_RUNS times a round: a few milliseconds of noise are several percent there.
        results: dict[tuple[str, str], Any] = {}
        for _ in range(max(1, args.repeats)):
            for key, fn, runner, inputs, lookup, stop in runs:
                for _ in range(QUICK_RUNS if key in results and results[key][0] < 1.0 else 1):
                    result = fn(runner, inputs, MAX_NEW_TOKENS, lookup, stop)
                    if key not in results or result[0] < results[key][0]:
                        results[key] = result
                log(f"   {label}/{key[0]}/{key[1]}: {result[0]:.2f}s")
        for (workload, engine), (wall, outputs, stats) in results.items():
            base_wall, base_outputs, _ = results[(workload, "ours")]
            tokens = sum(len(o) for o in outputs)
            same = sum(a == b for a, b in zip(outputs, base_outputs, strict=True))
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
    ]
    print()
    print(
        f"lookup: prompt_lookup_num_tokens={LOOKUP_TOKENS}, max_new_tokens={MAX_NEW_TOKENS}, greedy, threads={torch.get_num_threads()}"
    )
    print(common.markdown_table(rows, columns))
    print(
        "vLLM with n-gram speculation: not run here (no vLLM venv on this machine; benchmarks/vllm_engine.py "
        "runs vLLM from --vllm-python, without a speculative_config yet)"
    )
    return rows
