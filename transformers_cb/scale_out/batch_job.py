"""`transformers-cb generate --ray [ADDRESS] --replicas N`: the CLI's job as a Ray Data pipeline.

The driver reads and checks the prompt file (a local path or any URI pyarrow's filesystems open:
`s3://`, `gs://`, `hdfs://`, `file://`), Ray Data streams its rows through `N` `CBPredictor` actors,
and the driver writes one JSON line per input in input order as the results come back (a reorder
buffer keyed by row index; `preserve_order` keeps it small). The lines are those of the local CLI
(`jobs/records.py`). A killed actor is restarted by Ray (`max_restarts=-1`, Ray Data's default for an
actor pool) and its unfinished batch runs again (`max_task_retries=-1`, the same); a retried batch's
output is delivered once, and the driver checks that every index arrives exactly once.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from tqdm.auto import tqdm

from ..jobs.inputs import CliRequest, InputError, parse_requests, read_requests
from ..jobs.records import cb_overrides, format_summary, open_output
from ..models.registry_model import wants_chat
from . import require_ray_extra
from .predictor import CBPredictor

INDEX_COLUMN = "__row_index"


@dataclass
class RayJobOptions:
    """Where and how wide the job runs."""

    address: str | None = None  # None: the running cluster if there is one, else a local one
    replicas: int = 1
    batch_size: int = 256
    num_cpus: float = 1.0  # per actor
    num_gpus: float = 0.0  # per actor (1 on a GPU cluster; TP inside an actor takes more)
    predictor_kwargs: dict[str, object] = field(default_factory=dict)


def is_uri(path: str) -> bool:
    return "://" in path


def read_requests_anywhere(path: str | None) -> list[CliRequest]:
    """The prompts of `path`: the local CLI's reader, or through a pyarrow filesystem for a URI."""
    if path is None or not is_uri(path):
        return read_requests(path)
    from pyarrow import fs

    try:
        filesystem, inner = fs.FileSystem.from_uri(path)
        with filesystem.open_input_stream(inner) as stream:
            data = stream.read()
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot read input file {path!r}: {exc}") from None
    try:
        return parse_requests(data.decode("utf-8").splitlines())
    except UnicodeDecodeError as exc:
        raise InputError(f"input file {path!r} is not valid UTF-8: {exc.reason}") from None


@contextlib.contextmanager
def open_output_anywhere(path: str) -> Iterator[TextSink]:
    """`-` (stdout), a local file, or a URI written through a pyarrow filesystem."""
    if path == "-" or not is_uri(path):
        with open_output(path) as handle:
            yield handle
        return
    from pyarrow import fs

    filesystem, inner = fs.FileSystem.from_uri(path)
    with filesystem.open_output_stream(inner) as stream:
        yield _TextOver(stream)


class TextSink(Protocol):
    """Where the output lines go: a text file, or `_TextOver` a pyarrow stream."""

    def write(self, text: str, /) -> int: ...


class _TextOver:
    """Text lines written to a binary pyarrow stream as UTF-8, as they come (the file is never held whole)."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        self.stream.write(text.encode("utf-8"))
        return len(text)


@contextlib.contextmanager
def ray_session(address: str | None) -> Iterator[None]:
    """Connect to (or start) a cluster, unless this process is connected already; disconnect after."""
    import ray

    if ray.is_initialized():
        yield
        return
    ray.init(address=address, include_dashboard=False, log_to_driver=True, logging_level=logging.WARNING)
    try:
        yield
    finally:
        ray.shutdown()


def job_rows(requests: Sequence[CliRequest], default_max_new_tokens: int) -> list[dict[str, object]]:
    """The dataset's rows: each request's index, text and `max_new_tokens` (the command's default where the
    line gives none, as locally). The text is rendered on the actors (`CBPredictor`, jobs/prompts.py)."""
    return [
        {INDEX_COLUMN: i, "prompt": r.prompt, "max_new_tokens": r.max_new_tokens or default_max_new_tokens}
        for i, r in enumerate(requests)
    ]


def generate_on_ray(
    requests: Sequence[CliRequest],
    default_max_new_tokens: int,
    options: RayJobOptions,
    progress_bar: bool = True,
    predictor_class: type = CBPredictor,
) -> Iterator[dict[str, Any]]:
    """Each request's output row (the predictor's columns), in input order, each exactly once.

    Needs a connected Ray (`ray_session`). `predictor_class` is `CBPredictor` or a subclass."""
    import ray

    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True
    context.enable_progress_bars = False  # ours counts rows; Ray's would count blocks per operator
    dataset = ray.data.from_items(job_rows(requests, default_max_new_tokens)).map_batches(
        predictor_class,
        fn_constructor_kwargs=options.predictor_kwargs,
        batch_size=options.batch_size,
        compute=ray.data.ActorPoolStrategy(size=options.replicas),
        num_cpus=options.num_cpus,
        num_gpus=options.num_gpus or None,
        # No max_restarts / max_task_retries here: Ray Data's actor pool already sets both to -1 (restart a
        # dead actor, rerun its batch), and Ray 2.60 deprecates passing them as remote args.
    )
    waiting: dict[int, dict[str, Any]] = {}
    next_index = 0
    bar = tqdm(total=len(requests), desc="generate --ray", unit="req", disable=not progress_bar)
    with bar:
        for batch in dataset.iter_batches(batch_size=None, batch_format="numpy"):
            indices = [int(i) for i in batch[INDEX_COLUMN]]
            for position, index in enumerate(indices):
                if index < next_index or index in waiting:
                    raise RuntimeError(f"row {index} came back twice from the Ray job")
                waiting[index] = {name: values[position] for name, values in batch.items()}
            bar.update(len(indices))
            while next_index in waiting:
                yield waiting.pop(next_index)
                next_index += 1
    if next_index != len(requests) or waiting:
        raise RuntimeError(f"the Ray job returned {next_index} of {len(requests)} rows in order")


def record_from_row(request: CliRequest, row: dict[str, Any]) -> dict[str, Any]:
    """The local CLI's JSON line (jobs/records.py `build_record`) from a predictor's output row."""

    def seconds(value: Any) -> float | None:
        return None if value is None or value != value else round(float(value), 6)  # NaN: missing

    tokens = [int(t) for t in row["generated_token_ids"]]
    error = row["error"]
    return {
        "id": request.id,
        "text": str(row["generated_text"]),
        "token_ids": tokens,
        "finish_reason": None if row["finish_reason"] is None else str(row["finish_reason"]),
        "status": str(row["status"]),
        "error": None if error is None or error != error else str(error),
        "prompt_tokens": int(row["num_prompt_tokens"]),
        "generated_tokens": len(tokens),
        "ttft_s": seconds(row["ttft_s"]),
        "latency_s": seconds(row["latency_s"]),
    }


def job_options(args: argparse.Namespace) -> RayJobOptions:
    """The Ray job of `transformers-cb generate`'s arguments: each replica runs what the local command runs
    (cli/main.py `run_generate`): the same model, backend, dtype, device and seed, the same cache options,
    prompts rendered the same way (`--chat` / `--no-chat`, else the model's default: models/registry_model.py
    `wants_chat`; jobs/prompts.py renders them on the actors), the same greedy generation config
    (jobs/records.py `greedy_generation_config`) and the same speculation (`--prompt-lookup-num-tokens`,
    `--assistant-model`). `--threads` is the local process's: an actor's torch threads are its
    `--replica-cpus` (Ray sets `OMP_NUM_THREADS`)."""
    generation_config = (
        {}
        if args.prompt_lookup_num_tokens is None
        else {"prompt_lookup_num_tokens": args.prompt_lookup_num_tokens}
    )
    predictor_kwargs = {
        "model": args.model,
        "attn_implementation": args.attn_implementation,
        "dtype": args.dtype,
        "device": args.device,
        "seed": args.seed,
        "max_new_tokens": args.max_new_tokens,
        "apply_chat_template": wants_chat(args.chat, args.model),
        "generation_config": generation_config,
        "assistant_model": args.assistant_model,
        "continuous_batching_config": cb_overrides(args),
    }
    return RayJobOptions(
        address=args.ray or None,
        replicas=args.replicas,
        batch_size=args.ray_batch_size,
        num_cpus=args.replica_cpus,
        num_gpus=args.replica_gpus,
        predictor_kwargs=predictor_kwargs,
    )


def run_ray_generate(args: argparse.Namespace, predictor_class: type = CBPredictor) -> int:
    """`transformers-cb generate --ray`: exit 0, 1 when a request failed, 2 on bad input."""
    try:
        require_ray_extra("transformers-cb generate --ray", ("ray", "ray.data"))
    except ImportError as exc:
        raise InputError(str(exc)) from None
    requests = read_requests_anywhere(args.input)
    options = job_options(args)
    records = []
    with ray_session(options.address), open_output_anywhere(args.output) as handle:
        start = time.perf_counter()
        rows = (
            generate_on_ray(requests, args.max_new_tokens, options, not args.no_progress, predictor_class)
            if requests
            else iter(())
        )
        for request, row in zip(requests, rows, strict=True):
            record = record_from_row(request, row)
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
            records.append(record)
        wall_s = time.perf_counter() - start
    summary_stream = sys.stderr if args.output == "-" else sys.stdout
    print(format_summary(records, wall_s), file=summary_stream)
    return 1 if any(r["status"] != "FINISHED" for r in records) else 0
