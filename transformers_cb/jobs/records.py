"""Running a list of prompts to one result each, and a result as the CLI's JSON line.

`generate_rows` is one `generate_batch` call in which a request refused at submission becomes a `FAILED`
`RejectedOutput` instead of failing the others; `build_record` is the output line's schema. Shared by
`transformers-cb generate` (cli/main.py) and its Ray form (scale_out/), so both write the same lines.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any

from ..outputs import GenerationOutput
from .inputs import CliRequest, InputError

if TYPE_CHECKING:
    from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

    from ..config.continuous_batching import ContinuousBatchingConfig


@dataclass
class RejectedOutput:
    """Stands in for a ``GenerationOutput`` when ``generate_batch`` refused a request at submission."""

    prompt_ids: list[int]
    error: str
    generated_tokens: list[int] = field(default_factory=list)
    status: str = "FAILED"
    finish_reason: str = "error"
    logprobs: list[float] | None = None
    created_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None


# What a job's request ends with: the engine's output, or the refusal at submission.
JobOutput = GenerationOutput | RejectedOutput

_INPUT_INDEX = re.compile(r"^inputs\[(\d+)\]:\s*")


def generate_rows(
    model: PreTrainedModel,
    token_lists: Sequence[list[int]],
    generation_config: GenerationConfig,
    cb_config: ContinuousBatchingConfig | Mapping[str, object] | None,
    progress_bar: bool,
    per_input: Mapping[str, Sequence[object]] | None = None,
    **call_kwargs: object,
) -> list[JobOutput]:
    """One ``generate_batch`` call; results in input order.

    `per_input` holds per-request keyword arguments of ``generate_batch`` (``max_new_tokens``,
    ``temperature``, ...), one value per input. ``generate_batch`` validates every request before
    running any and raises a ``ValueError`` starting with ``inputs[i]:`` for a bad one (e.g. a prompt
    longer than the model's context). Such a request becomes a ``FAILED`` :class:`RejectedOutput`
    carrying that message, and the others are submitted again without it.
    """
    from ..api.generate_batch import batch_generating  # the model's stack: imported once a job runs

    per_input = per_input or {}
    rejected: dict[int, RejectedOutput] = {}
    while True:
        live = [i for i in range(len(token_lists)) if i not in rejected]
        if not live:
            return [rejected[i] for i in range(len(token_lists))]
        try:
            outputs = batch_generating(model).generate_batch(
                inputs=[token_lists[i] for i in live],
                generation_config=generation_config,
                continuous_batching_config=cb_config,
                progress_bar=progress_bar,
                **call_kwargs,
                **{name: [values[i] for i in live] for name, values in per_input.items()},
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
        by_position: dict[int, JobOutput] = {i: outputs[f"req_{k}"] for k, i in enumerate(live)}
        return [rejected[i] if i in rejected else by_position[i] for i in range(len(token_lists))]


#: `transformers-cb generate`'s cache options, `ContinuousBatchingConfig` fields of the same names.
CB_OPTIONS = ("max_batch_tokens", "page_size", "num_blocks", "kv_cache_dtype")


def cb_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The `ContinuousBatchingConfig` fields a `generate` command line sets (`CB_OPTIONS` given), for the
    local run and each Ray replica alike."""
    return {name: getattr(args, name) for name in CB_OPTIONS if getattr(args, name) is not None}


def greedy_generation_config(
    eos_token_id: int | list[int] | None, pad_token_id: int | None, fields: Mapping[str, object] | None = None
) -> GenerationConfig:
    """The jobs' `GenerationConfig`: greedy, with the model's eos and pad ids (models/loading.py
    `special_ids`), then `fields` over them (`prompt_lookup_num_tokens`; a `CBPredictor`'s
    `generation_config`). The local `generate` and its Ray replicas build theirs here."""
    from transformers import GenerationConfig

    base = {"do_sample": False, "eos_token_id": eos_token_id, "pad_token_id": pad_token_id}
    return GenerationConfig(**{**base, **(fields or {})})


def generate_all(
    model: PreTrainedModel,
    token_lists: Sequence[list[int]],
    max_new_tokens: Sequence[int],
    eos_token_id: int | list[int] | None,
    pad_token_id: int | None,
    cb_config: ContinuousBatchingConfig | None,
    progress_bar: bool,
    assistant_model: PreTrainedModel | None = None,
    prompt_lookup_num_tokens: int | None = None,
) -> list[JobOutput]:
    """The CLI's run: greedy, per-request ``max_new_tokens``, speculating with a draft model
    (``assistant_model``) or by prompt lookup where given; see :func:`generate_rows`."""
    generation_config = greedy_generation_config(
        eos_token_id, pad_token_id, {"prompt_lookup_num_tokens": prompt_lookup_num_tokens}
    )
    extra = {} if assistant_model is None else {"assistant_model": assistant_model}
    return generate_rows(
        model,
        token_lists,
        generation_config,
        cb_config,
        progress_bar,
        per_input={"max_new_tokens": list(max_new_tokens)},
        **extra,
    )


def status_name(status: object) -> str:
    return getattr(status, "name", None) or str(status)


def elapsed(start: float | None, end: float | None) -> float | None:
    if start is None or end is None:
        return None
    return round(end - start, 6)


def eos_set(eos_token_id: int | list[int] | tuple[int, ...] | set[int] | None) -> set[int]:
    if eos_token_id is None:
        return set()
    return set(eos_token_id) if isinstance(eos_token_id, (list, tuple, set)) else {eos_token_id}


def finish_reason(output: JobOutput, max_new_tokens: int, eos_ids: set[int]) -> str | None:
    reason = getattr(output, "finish_reason", None)
    if reason is not None:
        return str(reason)
    if status_name(output.status) != "FINISHED":
        return {"FAILED": "error"}.get(status_name(output.status), status_name(output.status).lower())
    tokens = list(output.generated_tokens)
    if tokens and tokens[-1] in eos_ids:
        return "stop"
    if len(tokens) >= max_new_tokens:
        return "length"
    return None


def build_record(
    request: CliRequest,
    output: JobOutput,
    tokenizer: PreTrainedTokenizerBase,
    max_new_tokens: int,
    eos_ids: set[int],
) -> dict:
    tokens = [int(t) for t in output.generated_tokens]
    created = getattr(output, "created_time", None)
    return {
        "id": request.id,
        "text": tokenizer.decode(tokens, skip_special_tokens=True),
        "token_ids": tokens,
        "finish_reason": finish_reason(output, max_new_tokens, eos_ids),
        "status": status_name(output.status),
        "error": getattr(output, "error", None),
        "prompt_tokens": len(output.prompt_ids),
        "generated_tokens": len(tokens),
        "ttft_s": elapsed(created, getattr(output, "first_token_time", None)),
        "latency_s": elapsed(created, getattr(output, "finish_time", None)),
    }


def format_summary(records: Sequence[dict], wall_s: float) -> str:
    generated = sum(r["generated_tokens"] for r in records)
    prompt = sum(r["prompt_tokens"] for r in records)
    failed = sum(1 for r in records if r["status"] != "FINISHED")
    rate = generated / wall_s if wall_s > 0 else 0.0
    return (
        f"requests: {len(records)}  failed: {failed}  prompt tokens: {prompt}  "
        f"generated tokens: {generated}  wall: {wall_s:.3f} s  throughput: {rate:.1f} generated tokens/s"
    )


@contextlib.contextmanager
def open_output(path: str) -> Iterator[IO[str]]:
    """The output lines' destination: `-` (stdout) or a local file."""
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
