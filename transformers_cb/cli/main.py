"""``transformers-cb``: batch generation from the command line.

``transformers-cb generate`` reads prompts (plain text or JSON lines), runs them
through ``model.generate_batch`` with continuous batching, and writes one JSON
object per prompt, in input order. See ``docs/cli.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import time
from collections import defaultdict, deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

EXIT_OK = 0
EXIT_REQUEST_FAILED = 1
EXIT_BAD_INPUT = 2

DEMO_PROMPTS = (
    "The quick brown fox jumps over the lazy dog.",
    "Continuous batching lets a server admit new requests at every step.",
    "Once upon a time, in a small village by the sea,",
    "The capital of France is",
    "A paged KV cache stores keys and values in fixed-size blocks.",
)

DTYPES = ("float32", "bfloat16", "float16")


class InputError(ValueError):
    """A problem with the user's input file; reported with exit code 2."""


@dataclass
class RejectedOutput:
    """Stands in for a ``GenerationOutput`` when ``generate_batch`` refused a request at submission."""

    prompt_ids: list[int]
    error: str
    generated_tokens: list[int] = field(default_factory=list)
    status: str = "FAILED"
    finish_reason: str = "failed"
    created_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None


@dataclass(frozen=True)
class CliRequest:
    """One prompt read from the input."""

    id: Any
    prompt: str
    max_new_tokens: int | None = None
    line_no: int | None = None


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
    return parser


# ---------------------------------------------------------------------------
# Input
# ---------------------------------------------------------------------------


def _parse_json_line(line: str, line_no: int, index: int) -> CliRequest:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise InputError(f"line {line_no}: invalid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(record, dict):
        raise InputError(f"line {line_no}: expected a JSON object, got {type(record).__name__}")
    if "prompt" not in record:
        raise InputError(f"line {line_no}: missing required key 'prompt'")
    prompt = record["prompt"]
    if not isinstance(prompt, str):
        raise InputError(f"line {line_no}: 'prompt' must be a string, got {type(prompt).__name__}")
    max_new_tokens = record.get("max_new_tokens")
    if max_new_tokens is not None and (
        isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0
    ):
        raise InputError(
            f"line {line_no}: 'max_new_tokens' must be a positive integer, got {max_new_tokens!r}"
        )
    request_id = record.get("id", index)
    if not isinstance(request_id, (str, int)) or isinstance(request_id, bool):
        raise InputError(f"line {line_no}: 'id' must be a string or an integer, got {request_id!r}")
    return CliRequest(id=request_id, prompt=prompt, max_new_tokens=max_new_tokens, line_no=line_no)


def parse_requests(lines: Iterable[str]) -> list[CliRequest]:
    """Parse input lines. Blank lines are skipped; ``{...}`` lines are JSON; others are prompts.

    Default ids are the 0-based position of the request among the non-blank lines.
    Raises :class:`InputError` naming the (1-based) line number on malformed input.
    """
    requests: list[CliRequest] = []
    seen_ids: dict[Any, int] = {}
    for line_no, raw in enumerate(lines, start=1):
        line = raw.rstrip("\r\n")
        if not line.strip():
            continue
        index = len(requests)
        if line.lstrip().startswith("{"):
            request = _parse_json_line(line, line_no, index)
        else:
            request = CliRequest(id=index, prompt=line, line_no=line_no)
        if request.id in seen_ids:
            raise InputError(
                f"line {line_no}: duplicate id {request.id!r} (first used on line {seen_ids[request.id]})"
            )
        seen_ids[request.id] = line_no
        requests.append(request)
    return requests


def read_requests(input_arg: str | None, stdin: IO[str] | None = None) -> list[CliRequest]:
    stdin = stdin if stdin is not None else sys.stdin
    if input_arg is None:
        if stdin is None or stdin.isatty():
            return [CliRequest(id=i, prompt=p) for i, p in enumerate(DEMO_PROMPTS)]
        return parse_requests(stdin)
    if input_arg == "-":
        return parse_requests(stdin)
    try:
        with open(input_arg, encoding="utf-8") as handle:
            return parse_requests(handle)
    except OSError as exc:
        raise InputError(f"cannot read input file {input_arg!r}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise InputError(f"input file {input_arg!r} is not valid UTF-8: {exc.reason}") from None


def tokenize_requests(tokenizer: Any, requests: Sequence[CliRequest]) -> list[list[int]]:
    token_lists = []
    for position, request in enumerate(requests):
        ids = list(tokenizer.encode(request.prompt))
        if not ids:
            where = f"line {request.line_no}" if request.line_no is not None else f"prompt {position}"
            raise InputError(f"{where}: the prompt encodes to zero tokens")
        token_lists.append(ids)
    return token_lists


# ---------------------------------------------------------------------------
# Generation
# ---------------------------------------------------------------------------


def _resolve_device(device: str | None) -> str:
    import torch

    if device is not None:
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


def _cb_config(args: argparse.Namespace) -> Any:
    import transformers_cb

    overrides = {
        name: getattr(args, name)
        for name in ("max_batch_tokens", "page_size", "num_blocks")
        if getattr(args, name) is not None
    }
    return transformers_cb.ContinuousBatchingConfig(**overrides)


def _special_ids(model: Any, tokenizer: Any) -> tuple[Any, Any]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    pad = getattr(model.generation_config, "pad_token_id", None)
    if pad is None:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    if isinstance(pad, list):
        pad = pad[0] if pad else None
    return eos, pad


def _match_outputs(outputs: dict[str, Any], inputs: Sequence[list[int]]) -> list[Any]:
    """Order ``generate_batch`` results like ``inputs``.

    Uses the ``req_<index>`` key scheme when present; otherwise matches by prompt ids
    (equal prompts in one greedy call produce equal outputs, so ties are harmless).
    """
    keys = [f"req_{i}" for i in range(len(inputs))]
    if len(outputs) == len(inputs) and all(key in outputs for key in keys):
        return [outputs[key] for key in keys]
    by_prompt: dict[tuple[int, ...], deque[Any]] = defaultdict(deque)
    for output in outputs.values():
        by_prompt[tuple(output.prompt_ids)].append(output)
    ordered = []
    for ids in inputs:
        bucket = by_prompt.get(tuple(ids))
        if not bucket:
            raise RuntimeError("generate_batch returned no result for one of the prompts")
        ordered.append(bucket.popleft())
    return ordered


def generate_grouped(
    model: Any,
    token_lists: Sequence[list[int]],
    max_new_tokens: Sequence[int],
    eos_token_id: Any,
    pad_token_id: Any,
    cb_config: Any,
    progress_bar: bool,
) -> list[Any]:
    """Run ``generate_batch`` once per distinct ``max_new_tokens``; results in input order."""
    from transformers import GenerationConfig

    groups: dict[int, list[int]] = defaultdict(list)
    for position, limit in enumerate(max_new_tokens):
        groups[limit].append(position)
    results: list[Any] = [None] * len(token_lists)
    for limit, positions in groups.items():
        generation_config = GenerationConfig(
            max_new_tokens=limit, do_sample=False, eos_token_id=eos_token_id, pad_token_id=pad_token_id
        )
        group_inputs = [token_lists[p] for p in positions]
        outputs = _generate_rejecting(model, group_inputs, generation_config, cb_config, progress_bar)
        for position, output in zip(positions, outputs, strict=True):
            results[position] = output
    return results


_INPUT_INDEX = re.compile(r"^inputs\[(\d+)\]:\s*")


def _generate_rejecting(
    model: Any, inputs: Sequence[list[int]], generation_config: Any, cb_config: Any, progress_bar: bool
) -> list[Any]:
    """``generate_batch`` over ``inputs``, results in order.

    ``generate_batch`` validates every request before running any and raises a
    ``ValueError`` starting with ``inputs[i]:`` for a bad one (e.g. a prompt longer than
    the model's context). Such a request becomes a ``FAILED`` :class:`RejectedOutput`
    carrying that message, and the others are submitted again without it.
    """
    rejected: dict[int, RejectedOutput] = {}
    while True:
        live = [i for i in range(len(inputs)) if i not in rejected]
        if not live:
            return [rejected[i] for i in range(len(inputs))]
        live_inputs = [inputs[i] for i in live]
        try:
            outputs = model.generate_batch(
                inputs=live_inputs,
                generation_config=generation_config,
                continuous_batching_config=cb_config,
                progress_bar=progress_bar,
            )
        except ValueError as exc:
            match = _INPUT_INDEX.match(str(exc))
            if match is None or int(match.group(1)) >= len(live):
                raise InputError(f"generation rejected the input: {exc}") from exc
            index = live[int(match.group(1))]
            rejected[index] = RejectedOutput(prompt_ids=list(inputs[index]), error=str(exc)[match.end() :])
            continue
        by_position = dict(zip(live, _match_outputs(outputs, live_inputs), strict=True))
        return [rejected[i] if i in rejected else by_position[i] for i in range(len(inputs))]


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
        return _status_name(output.status).lower()
    tokens = list(output.generated_tokens)
    if tokens and tokens[-1] in eos_ids:
        return "eos"
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
    import torch

    from transformers_cb.cli.tiny import load_model_and_tokenizer

    requests = read_requests(args.input)
    try:
        cb_config = _cb_config(args)
    except ValueError as exc:
        raise InputError(str(exc)) from None
    torch.manual_seed(args.seed)
    try:
        model, tokenizer = load_model_and_tokenizer(
            args.model,
            attn_implementation=args.attn_implementation,
            dtype=getattr(torch, args.dtype),
            device=_resolve_device(args.device),
            seed=args.seed,
        )
    except OSError as exc:
        raise InputError(f"cannot load model from {args.model!r}: {exc}") from None
    token_lists = tokenize_requests(tokenizer, requests)
    limits = [r.max_new_tokens or args.max_new_tokens for r in requests]
    eos_token_id, pad_token_id = _special_ids(model, tokenizer)

    with _open_output(args.output) as handle:
        start = time.perf_counter()
        outputs = (
            generate_grouped(
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
