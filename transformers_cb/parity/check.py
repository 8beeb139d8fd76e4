"""Check that continuous batching reproduces plain `generate()` on *your* model, token for token.

    python -m transformers_cb.conformance_check --model PATH [--prompts N] [--max-new-tokens M] [--attn paged|sdpa]

It loads the local checkpoint, draws random prompts, computes greedy references
with `model.generate()` on each prompt alone, then runs all prompts through
`model.generate_batch` under a few cache settings (small pages with a small
token budget for chunked prefill, large pages with the default budget, and a
cache just big enough for the largest request so that requests get evicted and
recomputed, and speculative decoding by prompt lookup and, with `--assistant-model`, by a draft model,
docs/speculative_decoding.md; left out for a model that cannot speculate). It prints a pass/fail table and
exits with status 1 on any
mismatch that is not a genuine floating-point near-tie. The comparison itself is `compare.py`.
"""

from __future__ import annotations

import argparse
import math
import random
import time
from collections.abc import Callable, Sequence

import torch
from transformers import PreTrainedModel

from ..config.continuous_batching import ContinuousBatchingConfig
from ..engine.speculation.draft_setup import speculation_refusal
from ..model_check.model_support import state_layout
from ..requests import RequestStatus
from .batch_runs import GENERATE_KWARGS, SettingResult, generate_batch_counting_preemptions
from .compare import (
    compare_tokens,
    greedy_config,
    plain_generation_config,
    reference_greedy,
)


def default_settings(
    max_total_tokens: int, speculation: bool = True, assistant_model: PreTrainedModel | None = None
) -> list[tuple[str, dict]]:
    """Cache settings to run, as (name, ContinuousBatchingConfig kwargs, plus `GENERATE_KWARGS`):
    speculation by prompt lookup unless the model cannot speculate (`speculation`), and with
    `assistant_model` by that draft model."""
    settings: list[tuple[str, dict]] = [
        ("page 16, budget 32 (chunked prefill)", {"page_size": 16, "max_batch_tokens": 32}),
        ("page 256, default budget", {"page_size": 256}),
        (
            "page 16, tight cache (eviction)",
            {"page_size": 16, "max_batch_tokens": 64, "num_blocks": math.ceil(max_total_tokens / 16) + 1},
        ),
    ]
    if speculation:
        settings.append(
            ("page 16, prompt lookup 4 (speculation)", {"page_size": 16, "prompt_lookup_num_tokens": 4})
        )
    if speculation and assistant_model is not None:
        settings.append(
            ("page 16, draft model (speculation)", {"page_size": 16, "assistant_model": assistant_model})
        )
    return settings


def speculation_refusal_of(model: PreTrainedModel) -> str | None:
    """Why `model` cannot speculate (its settings are left out of the check), or None."""
    return speculation_refusal(model, state_layout(model) is not None)


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
    assistant_model: PreTrainedModel | None = None,
) -> list[SettingResult]:
    if settings is None:
        settings = default_settings(
            max(len(p) for p in prompts) + max_new_tokens,
            speculation=speculation_refusal_of(model) is None,
            assistant_model=assistant_model,
        )
    config = greedy_config(max_new_tokens, eos_token_id)
    results = []
    with plain_generation_config(model, eos_token_id):
        references = [reference_greedy(model, prompt, config) for prompt in prompts]
        for name, kwargs in settings:
            details: list[str] = []
            result = SettingResult(name, num_requests=len(prompts), details=details)
            start = time.perf_counter()
            extra = {key: value for key, value in kwargs.items() if key in GENERATE_KWARGS}
            cb_kwargs = {key: value for key, value in kwargs.items() if key not in GENERATE_KWARGS}
            outputs, result.num_preemptions = generate_batch_counting_preemptions(
                model, prompts, config, ContinuousBatchingConfig(**cb_kwargs), **extra
            )
            result.seconds = time.perf_counter() - start
            for i, (prompt, expected) in enumerate(zip(prompts, references, strict=True)):
                output = outputs.get(f"req_{i}")
                if output is None or output.status != RequestStatus.FINISHED:
                    result.num_failed += 1
                    status = "missing" if output is None else f"{output.status.name}: {output.error}"
                    details.append(f"req_{i}: did not finish ({status})")
                    continue
                mismatch = compare_tokens(
                    model, f"req_{i}", prompt, expected, output.generated_tokens, tolerance
                )
                if mismatch is None:
                    result.num_match += 1
                elif mismatch.is_near_tie:
                    result.num_near_ties += 1
                    details.append(mismatch.describe())
                else:
                    result.num_failed += 1
                    details.append(mismatch.describe())
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
        "--assistant-model",
        default=None,
        help="a draft model (same tokenizer) to check speculative decoding with it too",
    )
    parser.add_argument(
        "--keep-eos",
        action="store_true",
        help="stop at the model's eos token (default: eos disabled, every prompt runs max-new-tokens)",
    )
    parser.add_argument(
        "--image",
        action="append",
        default=[],
        help="an image file (repeatable): prompts go through the model's processor with the images in turn, "
        "every other one text only (parity/media_check.py; needs Pillow)",
    )
    parser.add_argument("--processor", default=None, help="the processor's folder (default: the model's)")
    parser.add_argument(
        "--inputs",
        default=None,
        help="a torch.save'd list of processor outputs (dicts with input_ids and the processor's tensors), "
        "one per prompt, checked instead of random prompts",
    )
    parser.add_argument(
        "--tie-tolerance",
        type=float,
        default=None,
        help="logit gap below which a differing greedy choice counts as a near-tie "
        "(default: 1e-4 float32; 1e-2 float16 and 5e-2 bfloat16, or 2^-9 / 2^-6 of the top logit if more)",
    )
    args = parser.parse_args(argv)
    if args.prompts < 1 or args.max_new_tokens < 1 or not 1 <= args.min_prompt_len <= args.max_prompt_len:
        parser.error(
            "--prompts and --max-new-tokens must be >= 1 and 1 <= --min-prompt-len <= --max-prompt-len"
        )
    return args


def check_command(argv: Sequence[str] | None = None, model_folder: Callable[[str], str] | None = None) -> int:
    """The check on `--model`; `model_folder` turns that value into the folder loaded (the command passes
    the name lookup of models/fetch.py, a peer room this one does not import), else it is the folder."""
    args = parse_args(argv)
    from transformers import AutoModelForCausalLM

    import transformers_cb  # noqa: F401  (installs the plugin and registers the paged backends)

    folder = model_folder(args.model) if model_folder is not None else args.model
    if args.image or args.inputs:
        return _media_main(args, folder)
    model = AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation=args.attn, dtype=DTYPES[args.dtype]
    )
    model = model.to(args.device).eval()
    assistant = None
    if args.assistant_model is not None:
        assistant_folder = (
            model_folder(args.assistant_model) if model_folder is not None else args.assistant_model
        )
        loaded = AutoModelForCausalLM.from_pretrained(
            assistant_folder, attn_implementation=args.attn, dtype=DTYPES[args.dtype]
        )
        assistant = loaded.to(args.device).eval()
    refusal = speculation_refusal_of(model)
    if refusal is not None:
        print(f"speculation settings left out: {refusal}")
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
    results = run_check(
        model,
        prompts,
        args.max_new_tokens,
        eos_token_id=eos,
        tolerance=args.tie_tolerance,
        assistant_model=assistant,
    )
    return _report(results)


def _report(results: list[SettingResult]) -> int:
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


def _media_main(args: argparse.Namespace, folder: str) -> int:
    """The check with images (`--image` through the processor, or `--inputs`): parity/media_check.py."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from .media_check import load_inputs, processor_inputs, run_media_check

    model = AutoModelForImageTextToText.from_pretrained(
        folder, attn_implementation=args.attn, dtype=DTYPES[args.dtype]
    )
    model = model.to(args.device).eval()
    if args.inputs:
        inputs = load_inputs(args.inputs)
    else:
        processor = AutoProcessor.from_pretrained(args.processor or folder)
        inputs = processor_inputs(processor, args.image, args.prompts, args.seed)
    lengths = [int(item["input_ids"].shape[-1]) for item in inputs]
    print(
        f"model {args.model} ({type(model).__name__}, {args.attn}, {args.dtype}, {args.device}): "
        f"{len(inputs)} prompts with their media, {min(lengths)}-{max(lengths)} tokens, "
        f"{args.max_new_tokens} new tokens each"
    )
    eos = model.generation_config.eos_token_id if args.keep_eos else None
    settings = default_settings(max(lengths) + args.max_new_tokens, speculation_refusal_of(model) is None)
    return _report(run_media_check(model, inputs, args.max_new_tokens, settings, eos))
