"""The `structured` workload of benchmarks/throughput.py: guided decoding (JSON schemas) against none.

    python benchmarks/throughput.py --workloads structured [--models tiny,small] [--scale 0.5]

32 requests (x `--scale`), random prompts of 16-64 tokens, 64 new tokens at most, greedy, through
`transformers_cb` with a byte-level tokenizer padded with random multi-byte tokens to the model's vocabulary
(4096 for tiny, 32000 for small). Engines, side by side in one process:
    unconstrained   no request is guided
    guided          every request has its own JSON schema (an integer and a long string), llguidance masks
    mixed           every other request guided, the others unconstrained in the same steps
Reported per engine: wall time, generated tokens, tokens/s, the ratio to the unconstrained run, and the time spent
computing and applying masks. The mixed run's unconstrained requests must produce what they produce alone.
Then the sampler alone on random logits (the cost an unconstrained row pays when it shares a step with guided
ones): ms per step for k guided rows, for k guided + S unconstrained rows, and for S unconstrained rows.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from typing import Any
from unittest import mock

import common
import torch

NAME = "structured"
MAX_NEW_TOKENS = 64


def byte_tokenizer(vocab_size: int, seed: int = 0):
    """Byte-level BPE vocabulary (3 specials, 256 bytes), then random 2-8 byte tokens up to `vocab_size`."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789" * 2 + 'ĠĠ{}[]":,.-_'
    while len(vocab) < vocab_size:
        vocab.setdefault("".join(rng.choice(alphabet) for _ in range(rng.randint(2, 8))), len(vocab))
    backend = Tokenizer(BPE(vocab=vocab, merges=[], fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<pad>", "<s>", "</s>"])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


def schema(i: int) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            f"id_{i}": {"type": "integer", "minimum": 0, "maximum": 10**6},
            "text": {"type": "string"},
        },
        "required": [f"id_{i}", "text"],
    }


def make_workload(vocab_size: int, scale: float, seed: int) -> common.Workload:
    rng = random.Random(f"{NAME}/{seed}")
    requests = [
        common.Request(
            [rng.randrange(common.FIRST_PROMPT_TOKEN, vocab_size) for _ in range(rng.randint(16, 64))],
            MAX_NEW_TOKENS,
        )
        for _ in range(max(2, round(32 * scale)))
    ]
    return common.Workload(NAME, requests, description="prompts uniform in [16, 64], max_new_tokens 64")


def run_ours(
    model, tokenizer, workload: common.Workload, guided: list[Any]
) -> tuple[float, list[list[int]], float]:
    """Wall seconds, outputs in order, and seconds inside the grammar masks."""
    from transformers_cb import ContinuousBatchingConfig
    from transformers_cb.sampling.structured.grammars import GrammarCompiler

    mask_seconds = [0.0]
    original = GrammarCompiler.apply_masks

    def timed(self, *args: Any) -> None:
        t0 = time.perf_counter()
        original(self, *args)
        mask_seconds[0] += time.perf_counter() - t0

    model.set_attn_implementation("paged|sdpa")
    with mock.patch.object(GrammarCompiler, "apply_masks", timed):
        t0 = time.perf_counter()
        outputs = model.generate_batch(
            workload.inputs,
            generation_config=common.greedy_generation_config(MAX_NEW_TOKENS),
            continuous_batching_config=ContinuousBatchingConfig(),
            progress_bar=False,
            tokenizer=tokenizer,
            guided=guided,
        )
        wall = time.perf_counter() - t0
    common.restore_attn_implementation(model)
    return (
        wall,
        [outputs[f"req_{i}"].generated_tokens for i in range(len(workload.requests))],
        mask_seconds[0],
    )


def sampler_costs(tokenizer, vocab_size: int, guided_rows: int = 8, plain_rows: int = 56, repeats: int = 50):
    """ms per `Sampler.sample` call: k guided rows alone, k guided + S unconstrained, S unconstrained alone."""
    from transformers import GenerationConfig

    from transformers_cb.requests import Request
    from transformers_cb.sampling.request_state import SamplingSetup
    from transformers_cb.sampling.sampler import Sampler

    setup = SamplingSetup(
        GenerationConfig(do_sample=False), torch.device("cpu"), tokenizer=tokenizer, vocab_size=vocab_size
    )
    sampler = Sampler(setup.stages, False, torch.device("cpu"), setup.grammars)

    def requests(n_guided: int, n_plain: int) -> list[Request]:
        made = []
        for i in range(n_guided + n_plain):
            request = Request(f"r{i}", [5, 6, 7], MAX_NEW_TOKENS)
            setup.attach(request, {"guided": {"json": schema(i)}} if i < n_guided else {})
            made.append(request)
        return made

    results = {}
    for label, (k, s) in {
        f"{guided_rows} guided": (guided_rows, 0),
        f"{guided_rows} guided + {plain_rows} unconstrained": (guided_rows, plain_rows),
        f"{plain_rows} unconstrained": (0, plain_rows),
    }.items():
        batch = requests(k, s)
        logits = torch.randn(len(batch), vocab_size)
        best = float("inf")
        for _ in range(repeats):
            work = logits.clone()
            t0 = time.perf_counter()
            sampler.sample(work, batch)
            best = min(best, time.perf_counter() - t0)
        results[label] = best * 1e3
    return results


def run(args: argparse.Namespace, log) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for model_name in args.models:
        model = common.build_model(model_name, seed=args.seed)
        vocab = model.config.vocab_size
        tokenizer = byte_tokenizer(vocab, args.seed)
        workload = make_workload(vocab, args.scale, args.seed)
        n = len(workload.requests)
        log(f"== {NAME} / {model_name}: {n} requests, vocabulary {vocab}")
        runs = {
            "unconstrained": [None] * n,
            "guided": [{"json": schema(i)} for i in range(n)],
            "mixed": [{"json": schema(i)} if i % 2 == 0 else None for i in range(n)],
        }
        run_ours(model, tokenizer, common.make_warmup_workload(vocab), None)  # first-call costs
        results = {}
        for rep in range(args.repeats):  # interleaved, the fastest of each kept: the machine may be noisy
            for name, guided in runs.items():
                if args.wait_quiet > 0:
                    common.wait_for_quiet_cpu(args.quiet_load, args.wait_quiet)
                result = run_ours(model, tokenizer, workload, guided)
                log(f"   {name} run {rep + 1}: {result[0]:.2f}s")
                if name not in results or result[0] < results[name][0]:
                    results[name] = result
        base_wall, base_out, _ = results["unconstrained"]
        base_rate = sum(map(len, base_out)) / base_wall
        for name, (wall, outputs, mask_s) in results.items():
            tokens = sum(map(len, outputs))
            row = {
                "model": model_name,
                "engine": name,
                "requests": n,
                "gen_tokens": tokens,
                "wall_s": round(wall, 2),
                "gen_tok_s": round(tokens / wall, 1),
                "x_unconstrained_tok_s": round(tokens / wall / base_rate, 2),
                "mask_s": round(mask_s, 3),
                "mask_share": f"{mask_s / wall:.0%}",
            }
            if name == "mixed":
                same = [outputs[i] == base_out[i] for i in range(1, n, 2)]
                row["errors"] = "" if all(same) else f"{same.count(False)} unconstrained outputs changed"
            rows.append(row)
        costs = sampler_costs(tokenizer, vocab)
        for label, ms in costs.items():
            rows.append({"model": model_name, "engine": f"sampler: {label}", "sampler_ms": round(ms, 3)})
        del model
    columns = [
        ("model", "model"),
        ("engine", "engine"),
        ("requests", "reqs"),
        ("gen_tokens", "gen tok"),
        ("wall_s", "wall s"),
        ("gen_tok_s", "gen tok/s"),
        ("x_unconstrained_tok_s", "tok/s vs unconstrained"),
        ("mask_s", "mask s"),
        ("mask_share", "mask share"),
        ("sampler_ms", "sampler ms/step"),
        ("errors", "errors"),
    ]
    print(common.markdown_table(rows, columns))
    sys.stdout.flush()
    return rows
