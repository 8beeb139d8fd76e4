"""Reading the CLI's prompts: plain text lines or JSON lines, with errors naming the line; their token ids
(through the chat template with `--chat`) by `jobs/prompts.py`, as on the Ray actors."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING

from .prompts import NoChatTemplate, PromptFormat, prompt_ids

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# The seed documents' example (docs/real_model.md shows what the default model answers).
DEMO_PROMPTS = (
    "What's up?",
    "Name a cat breed.",
    "Write a detailed history of quantum mechanics.",
)


class InputError(ValueError):
    """A problem with the user's input file; reported with exit code 2."""


@dataclass(frozen=True)
class CliRequest:
    """One prompt read from the input."""

    id: object  # the JSON line's `id` (any JSON value), else the prompt's position
    prompt: str
    max_new_tokens: int | None = None
    line_no: int | None = None


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
    seen_ids: dict[object, int] = {}
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


def demo_requests() -> list[CliRequest]:
    return [CliRequest(id=i, prompt=p) for i, p in enumerate(DEMO_PROMPTS)]


def read_requests(input_arg: str | None, stdin: IO[str] | None = None) -> list[CliRequest]:
    """The requests of `--input` (a file, or '-' for stdin, read even when empty).

    Without `--input`: stdin when it is redirected and holds at least one prompt; otherwise (a terminal,
    `/dev/null`, an empty file or pipe, a closed stdin) the demo prompts, so a script or CI run of the
    main job shows its work too. A pipe is read to its end, as any filter does."""
    stdin = stdin if stdin is not None else sys.stdin
    if input_arg is None:
        if stdin is None or stdin.closed or stdin.isatty():
            return demo_requests()
        requests = parse_requests(stdin)
        if not requests:
            print("transformers-cb: stdin is empty; running the built-in demo prompts", file=sys.stderr)
            return demo_requests()
        return requests
    if input_arg == "-":
        return parse_requests(stdin)
    try:
        with open(input_arg, encoding="utf-8") as handle:
            return parse_requests(handle)
    except OSError as exc:
        raise InputError(f"cannot read input file {input_arg!r}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise InputError(f"input file {input_arg!r} is not valid UTF-8: {exc.reason}") from None


def tokenize_requests(
    tokenizer: PreTrainedTokenizerBase,
    requests: Sequence[CliRequest],
    prompt_format: PromptFormat | None = None,
) -> list[list[int]]:
    """Each prompt's ids under `prompt_format` (default: the text as it is; with `chat`, one user message
    through the chat template): `jobs/prompts.py` `prompt_ids`, the rendering the Ray actors use too."""
    prompt_format = prompt_format or PromptFormat()
    token_lists = []
    for position, request in enumerate(requests):
        where = f"line {request.line_no}" if request.line_no is not None else f"prompt {position}"
        try:
            ids = prompt_ids(tokenizer, request.prompt, prompt_format)
        except NoChatTemplate:
            raise InputError("--chat: the model's tokenizer has no chat template") from None
        if not ids:
            raise InputError(f"{where}: the prompt encodes to zero tokens")
        token_lists.append(ids)
    return token_lists


# ---------------------------------------------------------------------------
# Generation
# ---------------------------------------------------------------------------
