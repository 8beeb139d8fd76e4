"""``transformers-cb``: batch generation from the command line.

``transformers-cb generate`` reads prompts (plain text or JSON lines), runs them
through ``model.generate_batch`` with continuous batching, and writes one JSON
object per prompt, in input order. See ``docs/cli.md``. ``transformers-cb serve``
(``transformers_cb/serve/``) is an OpenAI-compatible HTTP server; see ``docs/serve.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from ..serve.server import add_serve_parser
from .inputs import CliRequest, InputError, read_requests, tokenize_requests

EXIT_OK = 0
EXIT_REQUEST_FAILED = 1
EXIT_BAD_INPUT = 2

DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class RejectedOutput:
    """Stands in for a ``GenerationOutput`` when ``generate_batch`` refused a request at submission."""

    prompt_ids: list[int]
    error: str
    generated_tokens: list[int] = field(default_factory=list)
    status: str = "FAILED"
    finish_reason: str = "error"
    created_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None


# ---------------------------------------------------------------------------
# Argument parsing
# ---------------------------------------------------------------------------


def _positive_int(text: str) -> int:
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
        default=None,
        help="local model directory (save_pretrained layout); default: a built-in tiny random Llama",
    )
    gen.add_argument(
        "--input",
        default=None,
        help="prompt file, or '-' for stdin; default: stdin when piped, else built-in demo prompts",
    )
    gen.add_argument("--output", default="-", help="JSONL output file, or '-' for stdout (default)")
    gen.add_argument("--max-new-tokens", type=_positive_int, default=32, help="default: 32")
    gen.add_argument("--max-batch-tokens", type=_positive_int, default=None, help="query tokens per step")
    gen.add_argument("--page-size", type=_positive_int, default=None, help="KV tokens per cache page")
    gen.add_argument("--num-blocks", type=_positive_int, default=None, help="number of KV cache pages")
    gen.add_argument(
        "--attn-implementation",
        default="paged|sdpa",
        help="attention backend, e.g. paged|sdpa (default), paged|eager, paged|flash_attention_2",
    )
    gen.add_argument("--dtype", choices=DTYPES, default="float32", help="model dtype (default: float32)")
    gen.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    gen.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    gen.add_argument(
        "--seed", type=int, default=0, help="torch seed; also seeds the built-in model's weights (default: 0)"
    )
    gen.set_defaults(func=run_generate)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="transformers-cb", description="Continuous batching for Hugging Face Transformers."
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    _add_generate_parser(subparsers)
    add_serve_parser(subparsers)
    return parser


# ---------------------------------------------------------------------------
# Input
# ---------------------------------------------------------------------------


def _cb_config(args: argparse.Namespace) -> Any:
    import transformers_cb

    overrides = {
        name: getattr(args, name)
        for name in ("max_batch_tokens", "page_size", "num_blocks")
        if getattr(args, name) is not None
    }
    return transformers_cb.ContinuousBatchingConfig(**overrides)


def generate_all(
    model: Any,
    token_lists: Sequence[list[int]],
    max_new_tokens: Sequence[int],
    eos_token_id: Any,
    pad_token_id: Any,
    cb_config: Any,
    progress_bar: bool,
) -> list[Any]:
    """One ``generate_batch`` call (per-request ``max_new_tokens``); results in input order.

    ``generate_batch`` validates every request before running any and raises a
    ``ValueError`` starting with ``inputs[i]:`` for a bad one (e.g. a prompt longer than
    the model's context). Such a request becomes a ``FAILED`` :class:`RejectedOutput`
    carrying that message, and the others are submitted again without it.
    """
    from transformers import GenerationConfig

    generation_config = GenerationConfig(
        do_sample=False, eos_token_id=eos_token_id, pad_token_id=pad_token_id
    )
    rejected: dict[int, RejectedOutput] = {}
    while True:
        live = [i for i in range(len(token_lists)) if i not in rejected]
        if not live:
            return [rejected[i] for i in range(len(token_lists))]
        try:
            outputs = model.generate_batch(
                inputs=[token_lists[i] for i in live],
                generation_config=generation_config,
                continuous_batching_config=cb_config,
                progress_bar=progress_bar,
                max_new_tokens=[max_new_tokens[i] for i in live],
            )
        except ValueError as exc:
            match = _INPUT_INDEX.match(str(exc))
            if match is None or int(match.group(1)) >= len(live):
                raise InputError(f"generation rejected the input: {exc}") from exc
            index = live[int(match.group(1))]
            rejected[index] = RejectedOutput(
                prompt_ids=list(token_lists[index]), error=str(exc)[match.end() :]
            )
            continue
        # generate_batch keys results "req_<position in its inputs>".
        by_position = {i: outputs[f"req_{k}"] for k, i in enumerate(live)}
        return [rejected[i] if i in rejected else by_position[i] for i in range(len(token_lists))]


_INPUT_INDEX = re.compile(r"^inputs\[(\d+)\]:\s*")


# ---------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------


def _status_name(status: Any) -> str:
    return getattr(status, "name", None) or str(status)


def _elapsed(start: float | None, end: float | None) -> float | None:
    if start is None or end is None:
        return None
    return round(end - start, 6)


def _eos_set(eos_token_id: Any) -> set[int]:
    if eos_token_id is None:
        return set()
    return set(eos_token_id) if isinstance(eos_token_id, (list, tuple, set)) else {eos_token_id}


def _finish_reason(output: Any, max_new_tokens: int, eos_ids: set[int]) -> str | None:
    reason = getattr(output, "finish_reason", None)
    if reason is not None:
        return str(reason)
    if _status_name(output.status) != "FINISHED":
        return {"FAILED": "error"}.get(_status_name(output.status), _status_name(output.status).lower())
    tokens = list(output.generated_tokens)
    if tokens and tokens[-1] in eos_ids:
        return "stop"
    if len(tokens) >= max_new_tokens:
        return "length"
    return None


def build_record(
    request: CliRequest, output: Any, tokenizer: Any, max_new_tokens: int, eos_ids: set[int]
) -> dict:
    tokens = [int(t) for t in output.generated_tokens]
    created = getattr(output, "created_time", None)
    return {
        "id": request.id,
        "text": tokenizer.decode(tokens, skip_special_tokens=True),
        "token_ids": tokens,
        "finish_reason": _finish_reason(output, max_new_tokens, eos_ids),
        "status": _status_name(output.status),
        "error": getattr(output, "error", None),
        "prompt_tokens": len(output.prompt_ids),
        "generated_tokens": len(tokens),
        "ttft_s": _elapsed(created, getattr(output, "first_token_time", None)),
        "latency_s": _elapsed(created, getattr(output, "finish_time", None)),
    }


@contextlib.contextmanager
def _open_output(path: str) -> Iterator[IO[str]]:
    if path == "-":
        yield sys.stdout
        sys.stdout.flush()
        return
    try:
        handle = open(path, "w", encoding="utf-8")  # noqa: SIM115  (closed below)
    except OSError as exc:
        raise InputError(f"cannot write output file {path!r}: {exc.strerror}") from None
    with handle:
        yield handle


def format_summary(records: Sequence[dict], wall_s: float) -> str:
    generated = sum(r["generated_tokens"] for r in records)
    prompt = sum(r["prompt_tokens"] for r in records)
    failed = sum(1 for r in records if r["status"] != "FINISHED")
    rate = generated / wall_s if wall_s > 0 else 0.0
    return (
        f"requests: {len(records)}  failed: {failed}  prompt tokens: {prompt}  "
        f"generated tokens: {generated}  wall: {wall_s:.3f} s  throughput: {rate:.1f} generated tokens/s"
    )


# ---------------------------------------------------------------------------
# Commands
# ---------------------------------------------------------------------------


def run_generate(args: argparse.Namespace) -> int:
    from .loading import load_for_command, special_ids

    requests = read_requests(args.input)
    try:
        cb_config = _cb_config(args)
    except ValueError as exc:
        raise InputError(str(exc)) from None
    try:
        model, tokenizer = load_for_command(args)
    except OSError as exc:
        raise InputError(f"cannot load model from {args.model!r}: {exc}") from None
    token_lists = tokenize_requests(tokenizer, requests)
    limits = [r.max_new_tokens or args.max_new_tokens for r in requests]
    eos_token_id, pad_token_id = special_ids(model, tokenizer)

    with _open_output(args.output) as handle:
        start = time.perf_counter()
        outputs = (
            generate_all(
                model, token_lists, limits, eos_token_id, pad_token_id, cb_config, not args.no_progress
            )
            if requests
            else []
        )
        wall_s = time.perf_counter() - start
        eos_ids = _eos_set(eos_token_id)
        records = [
            build_record(req, out, tokenizer, limit, eos_ids)
            for req, out, limit in zip(requests, outputs, limits, strict=True)
        ]
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
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
