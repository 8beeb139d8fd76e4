"""Check that continuous batching reproduces plain `generate()` on *your* model, token for token.

    python -m transformers_cb.conformance_check --model PATH [--prompts N] [--max-new-tokens M] [--attn paged|sdpa]

(from a source checkout, `python -m conformance.check_model ...` is the same command).

It loads the local checkpoint, draws random prompts, computes greedy references
with `model.generate()` on each prompt alone, then runs all prompts through
`model.generate_batch` under a few cache settings (small pages with a small
token budget for chunked prefill, large pages with the default budget, and a
cache just big enough for the largest request so that requests get evicted and
recomputed). It prints a pass/fail table and exits with status 1 on any
mismatch that is not a genuine floating-point near-tie.

The comparison helpers here (`reference_greedy`, `compare_tokens`,
`Mismatch.describe`) are also what the `conformance/` test suite uses.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, PreTrainedModel

# Below this logit gap between the reference's token and ours, a different greedy choice is a
# floating-point near-tie (two summation orders legitimately disagree), not a bug.
NEAR_TIE_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}


def near_tie_tolerance(dtype: torch.dtype) -> float:
    return NEAR_TIE_TOLERANCE.get(dtype, 1e-4)


# -- references ------------------------------------------------------------------------------------
def greedy_config(
    max_new_tokens: int, eos_token_id: int | list[int] | None = None, **kwargs
) -> GenerationConfig:
    """Greedy decoding; `eos_token_id=None` disables eos (set `model.generation_config.eos_token_id`
    to None as well, or both `generate()` and `generate_batch` take the model's)."""
    return GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, num_beams=1, eos_token_id=eos_token_id, **kwargs
    )


@contextmanager
def plain_generation_config(model: PreTrainedModel, eos_token_id: int | list[int] | None) -> Iterator[None]:
    """Swap the model's generation config for a neutral greedy one (its bos/pad ids and `eos_token_id`),
    so that checkpoint defaults (sampling, repetition penalty, ...) do not enter the comparison."""
    saved = model.generation_config
    model.generation_config = GenerationConfig(
        bos_token_id=saved.bos_token_id, pad_token_id=saved.pad_token_id, eos_token_id=eos_token_id
    )
    try:
        yield
    finally:
        model.generation_config = saved


@torch.inference_mode()
def reference_greedy(
    model: PreTrainedModel, prompt: Sequence[int], generation_config: GenerationConfig
) -> list[int]:
    """`model.generate()` on `prompt` alone (batch of one, no padding); the generated ids only."""
    device = next(model.parameters()).device
    input_ids = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    output = model.generate(
        input_ids, attention_mask=torch.ones_like(input_ids), generation_config=generation_config
    )
    return output[0, input_ids.shape[1] :].tolist()


@torch.inference_mode()
def next_token_logits(model: PreTrainedModel, ids: Sequence[int]) -> torch.Tensor:
    """Float32 logits of the token after `ids`, from one plain full forward (no KV cache)."""
    device = next(model.parameters()).device
    input_ids = torch.tensor([list(ids)], dtype=torch.long, device=device)
    output = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), use_cache=False)
    return output.logits[0, -1].float()


# -- comparison --------------------------------------------------------------------------------------
@dataclass
class Mismatch:
    """First difference between the reference (`generate()`) and continuous batching for one prompt."""

    request_id: str
    prompt: list[int]
    expected: list[int]  # generate()
    actual: list[int]  # generate_batch
    index: int  # first differing position in the generated tokens
    margin: float | None = None  # logit(max) - logit(actual token) at `index`; None: a length mismatch
    top2_margin: float | None = None  # logit(top1) - logit(top2) at `index`
    tolerance: float = 1e-4

    @property
    def is_near_tie(self) -> bool:
        return self.margin is not None and self.margin < self.tolerance

    def describe(self, context: int = 4) -> str:
        lines = [
            f"{self.request_id}: generate_batch differs from generate() at generated position {self.index} "
            f"(prompt of {len(self.prompt)} tokens)",
            f"  generate():       {self.expected}",
            f"  generate_batch(): {self.actual}",
        ]
        if self.margin is None:
            lines.append(
                f"  lengths differ ({len(self.expected)} vs {len(self.actual)} tokens): stopping disagrees"
            )
        else:
            kind = "NEAR-TIE" if self.is_near_tie else "NOT a near-tie"
            lines.append(
                f"  reference logits at that position: top1-top2 = {self.top2_margin:.3g}, "
                f"max - logit(generate_batch's token) = {self.margin:.3g} ({kind}, tolerance {self.tolerance:g})"
            )
        lines.append("  pos | generate() | generate_batch()")
        end = max(len(self.expected), len(self.actual))
        for pos in range(max(0, self.index - context), min(end, self.index + context + 1)):
            expected = self.expected[pos] if pos < len(self.expected) else "-"
            actual = self.actual[pos] if pos < len(self.actual) else "-"
            marker = "  <-- first difference" if pos == self.index else ""
            lines.append(f"  {pos:>3} | {expected!s:>10} | {actual!s:>16}{marker}")
        return "\n".join(lines)


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_tokens(
    model: PreTrainedModel,
    request_id: str,
    prompt: Sequence[int],
    expected: Sequence[int],
    actual: Sequence[int],
    tolerance: float | None = None,
) -> Mismatch | None:
    """None when equal; else a `Mismatch` whose margin is measured with a plain forward of the model
    on `prompt + expected[:index]` (raw logits, before any logits processor)."""
    index = first_difference(expected, actual)
    if index is None:
        return None
    if tolerance is None:
        tolerance = near_tie_tolerance(next(model.parameters()).dtype)
    mismatch = Mismatch(request_id, list(prompt), list(expected), list(actual), index, tolerance=tolerance)
    if index < min(len(expected), len(actual)):
        logits = next_token_logits(model, [*prompt, *expected[:index]])
        top2 = logits.topk(2).values
        mismatch.top2_margin = float(top2[0] - top2[1])
        mismatch.margin = float(logits.max() - logits[actual[index]])
    return mismatch


@contextmanager
def count_preemptions() -> Iterator[list[str]]:
    """Records the request id of every preemption (`Scheduler.preempt` call) inside the block."""
    from ..engine.scheduler import Scheduler

    calls: list[str] = []
    original = Scheduler.preempt

    def preempt(self, request, batch):
        calls.append(request.request_id)
        return original(self, request, batch)

    Scheduler.preempt = preempt
    try:
        yield calls
    finally:
        Scheduler.preempt = original


# -- the command -------------------------------------------------------------------------------------
@dataclass
class SettingResult:
    name: str
    num_requests: int = 0
    num_match: int = 0
    num_near_ties: int = 0
    num_failed: int = 0  # mismatches that are not near-ties, and requests that did not finish
    num_preemptions: int = 0
    seconds: float = 0.0
    details: list[str] | None = None

    @property
    def passed(self) -> bool:
        return self.num_failed == 0


def default_settings(max_total_tokens: int) -> list[tuple[str, dict]]:
    """Cache settings to run, as (name, ContinuousBatchingConfig kwargs)."""
    return [
        ("page 16, budget 32 (chunked prefill)", {"page_size": 16, "max_batch_tokens": 32}),
        ("page 256, default budget", {"page_size": 256}),
        (
            "page 16, tight cache (eviction)",
            {"page_size": 16, "max_batch_tokens": 64, "num_blocks": math.ceil(max_total_tokens / 16) + 1},
        ),
    ]


def random_prompts(
    count: int, vocab_size: int, min_len: int, max_len: int, seed: int, avoid: Sequence[int] = ()
) -> list[list[int]]:
    rng = random.Random(seed)
    allowed = sorted(set(range(vocab_size)) - set(avoid))
    return [[rng.choice(allowed) for _ in range(rng.randint(min_len, max_len))] for _ in range(count)]


def run_check(
    model: PreTrainedModel,
    prompts: list[list[int]],
    max_new_tokens: int,
    settings: list[tuple[str, dict]] | None = None,
    eos_token_id: int | list[int] | None = None,
    tolerance: float | None = None,
) -> list[SettingResult]:
    from .. import ContinuousBatchingConfig, RequestStatus

    if tolerance is None:
        tolerance = near_tie_tolerance(next(model.parameters()).dtype)
    if settings is None:
        settings = default_settings(max(len(p) for p in prompts) + max_new_tokens)
    config = greedy_config(max_new_tokens, eos_token_id)
    results = []
    with plain_generation_config(model, eos_token_id):
        references = [reference_greedy(model, prompt, config) for prompt in prompts]
        for name, kwargs in settings:
            result = SettingResult(name, num_requests=len(prompts), details=[])
            start = time.perf_counter()
            with count_preemptions() as preemptions:
                outputs = model.generate_batch(
                    prompts,
                    generation_config=config,
                    continuous_batching_config=ContinuousBatchingConfig(**kwargs),
                    progress_bar=False,
                )
            result.seconds = time.perf_counter() - start
            result.num_preemptions = len(preemptions)
            for i, (prompt, expected) in enumerate(zip(prompts, references, strict=True)):
                output = outputs.get(f"req_{i}")
                if output is None or output.status != RequestStatus.FINISHED:
                    result.num_failed += 1
                    status = "missing" if output is None else f"{output.status.name}: {output.error}"
                    result.details.append(f"req_{i}: did not finish ({status})")
                    continue
                mismatch = compare_tokens(
                    model, f"req_{i}", prompt, expected, output.generated_tokens, tolerance
                )
                if mismatch is None:
                    result.num_match += 1
                elif mismatch.is_near_tie:
                    result.num_near_ties += 1
                    result.details.append(mismatch.describe())
                else:
                    result.num_failed += 1
                    result.details.append(mismatch.describe())
            results.append(result)
    return results


def format_table(results: list[SettingResult]) -> str:
    header = ("setting", "requests", "match", "near-ties", "mismatch", "evictions", "seconds", "result")
    rows = [
        (
            r.name,
            str(r.num_requests),
            str(r.num_match),
            str(r.num_near_ties),
            str(r.num_failed),
            str(r.num_preemptions),
            f"{r.seconds:.2f}",
            "PASS" if r.passed else "FAIL",
        )
        for r in results
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
        for row in [header, *rows]
    ]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m transformers_cb.conformance_check",
        description="Check that model.generate_batch (continuous batching) reproduces model.generate() "
        "token for token on a local checkpoint.",
    )
    parser.add_argument(
        "--model",
        required=True,
        help="local checkpoint directory (save_pretrained layout), or smollm2 (the real model, fetched once)",
    )
    parser.add_argument("--prompts", type=int, default=8, help="number of random prompts (default 8)")
    parser.add_argument(
        "--max-new-tokens", type=int, default=16, help="tokens generated per prompt (default 16)"
    )
    parser.add_argument("--min-prompt-len", type=int, default=1)
    parser.add_argument("--max-prompt-len", type=int, default=64)
    parser.add_argument(
        "--attn",
        default="paged|sdpa",
        choices=["paged|sdpa", "paged|eager", "sdpa", "eager"],
        help="attn_implementation the model is loaded with (default paged|sdpa)",
    )
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    parser.add_argument(
        "--keep-eos",
        action="store_true",
        help="stop at the model's eos token (default: eos disabled, every prompt runs max-new-tokens)",
    )
    parser.add_argument(
        "--tie-tolerance",
        type=float,
        default=None,
        help="logit gap below which a differing greedy choice counts as a near-tie "
        "(default: 1e-4 float32, 1e-2 float16, 5e-2 bfloat16)",
    )
    args = parser.parse_args(argv)
    if args.prompts < 1 or args.max_new_tokens < 1 or not 1 <= args.min_prompt_len <= args.max_prompt_len:
        parser.error(
            "--prompts and --max-new-tokens must be >= 1 and 1 <= --min-prompt-len <= --max-prompt-len"
        )
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import AutoModelForCausalLM

    import transformers_cb  # noqa: F401  (installs the plugin and registers the paged backends)

    from ..models.fetch import resolve_model

    model = AutoModelForCausalLM.from_pretrained(
        resolve_model(args.model) or args.model, attn_implementation=args.attn, dtype=DTYPES[args.dtype]
    )
    model = model.to(args.device).eval()
    generation_config = model.generation_config
    eos = generation_config.eos_token_id if args.keep_eos else None
    special = [
        t
        for t in (
            generation_config.bos_token_id,
            generation_config.pad_token_id,
            generation_config.eos_token_id,
        )
        for t in (t if isinstance(t, list) else [t])
        if t is not None
    ]
    vocab_size = model.config.get_text_config().vocab_size
    prompts = random_prompts(
        args.prompts, vocab_size, args.min_prompt_len, args.max_prompt_len, args.seed, special
    )
    print(
        f"model {args.model} ({type(model).__name__}, {args.attn}, {args.dtype}, {args.device}): "
        f"{len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
        f"{args.max_new_tokens} new tokens each, eos {'on' if args.keep_eos else 'off'}"
    )
    results = run_check(model, prompts, args.max_new_tokens, eos_token_id=eos, tolerance=args.tie_tolerance)
    print(format_table(results))
    for result in results:
        for detail in result.details or []:
            print(f"\n[{result.name}] {detail}")
    passed = all(r.passed for r in results)
    num_ties = sum(r.num_near_ties for r in results)
    print(
        f"\n{'PASS' if passed else 'FAIL'}: generate_batch "
        f"{'matches' if passed else 'does NOT match'} generate()"
        + (f" ({num_ties} floating-point near-tie(s) reported above)" if num_ties else "")
    )
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
