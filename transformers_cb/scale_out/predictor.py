"""`CBPredictor`: the callable class of Ray Data's `Dataset.map_batches`, one model and engine per actor.

    ds.map_batches(CBPredictor, fn_constructor_kwargs={"model": "/models/x"}, batch_size=256,
                   compute=ray.data.ActorPoolStrategy(size=4), num_gpus=1)

Ray builds the class once per actor (the model loads in `__init__`) and calls it on every batch the
streaming executor hands that actor. A batch is a dict of columns (Ray Data's default format); each
row's prompt is text (`prompt`, optionally through the tokenizer's chat template), a chat (`messages`)
or token ids (`prompt_token_ids`). Columns named like a per-request argument of `generate_batch`
(`max_new_tokens`, `temperature`, `top_p`, `seed`, `stop_strings`, ...) set that row's value; a missing
value (None / NaN) means the predictor's default. The batch runs as one `generate_batch` call on the
actor's persistent engine, and the output rows are the input rows, in their order, plus the generated
columns (`OUTPUT_COLUMNS`). A row refused at submission (empty prompt, too long, bad parameter) gets
status `FAILED` and its error; the other rows of the batch still run.

Nothing here imports Ray: the class is plain Python, and Ray pickles it to its actors.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..config.continuous_batching import ContinuousBatchingConfig
from ..jobs.prompts import NoChatTemplate, PromptFormat, chat_ids, prompt_ids
from ..jobs.records import (
    JobOutput,
    eos_set,
    finish_reason,
    generate_rows,
    greedy_generation_config,
    status_name,
)
from ..models.loading import load_model_and_tokenizer, resolve_device, special_ids
from ..sampling.params import PER_REQUEST_KWARGS, VECTOR_PARAMS

TEXT_COLUMN = "prompt"
MESSAGES_COLUMN = "messages"
TOKEN_IDS_COLUMN = "prompt_token_ids"
# Per-row columns handed to generate_batch as per-request arguments.
SAMPLING_COLUMNS = ("max_new_tokens", *PER_REQUEST_KWARGS)
OUTPUT_COLUMNS = (
    "generated_text",
    "generated_token_ids",
    "finish_reason",
    "status",
    "error",
    "num_prompt_tokens",
    "num_generated_tokens",
    "ttft_s",
    "latency_s",
)
NO_TEMPLATE = "the tokenizer has no chat template: pass chat_template=... to CBPredictor"
LOGPROBS_COLUMN = "logprobs"  # with return_logprobs=True: one log-probability per generated token


class CBPredictor:
    """Generate for every row of a Ray Data batch with continuous batching (see the module docstring).

    Args:
        model: a local checkpoint directory (`save_pretrained` layout, on every node), or None for the
            built-in tiny model.
        attn_implementation, dtype, device, seed: as `transformers-cb generate` takes them.
        prompt_column: the text column (default `prompt`).
        apply_chat_template: wrap each text prompt as one user message of the tokenizer's chat template
            (a `messages` column always goes through the template); rendered by `jobs/prompts.py`, as the
            local `transformers-cb generate --chat` renders it.
        system_prompt: with `apply_chat_template`, a system message before each text prompt.
        chat_template: a Jinja template for a tokenizer that has none.
        max_new_tokens: the default of rows without a `max_new_tokens` value.
        return_logprobs: add a `logprobs` column.
        detokenize: decode the generated tokens into `generated_text` (False: None there, for jobs
            that only want token ids).
        generation_config: `GenerationConfig` fields (default greedy; `do_sample=True` to sample;
            `prompt_lookup_num_tokens` to speculate by prompt lookup).
        assistant_model: a draft model for speculative decoding (a directory or a registry name, as
            `model`), loaded with the model's backend, dtype, device and seed.
        continuous_batching_config: `ContinuousBatchingConfig` fields (`num_blocks`, `max_batch_tokens`,
            `per_request_processors=True` for per-row temperature / top-p / ..., ...).
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        attn_implementation: str = "paged|sdpa",
        dtype: str = "float32",
        device: str | None = None,
        seed: int = 0,
        prompt_column: str = TEXT_COLUMN,
        apply_chat_template: bool = False,
        system_prompt: str | None = None,
        chat_template: str | None = None,
        max_new_tokens: int = 32,
        return_logprobs: bool = False,
        detokenize: bool = True,
        generation_config: Mapping[str, object] | None = None,
        continuous_batching_config: Mapping[str, Any] | None = None,
        assistant_model: str | None = None,
    ) -> None:
        import torch

        started = time.perf_counter()
        torch.manual_seed(seed)
        loaded = (attn_implementation, getattr(torch, dtype), resolve_device(device), seed)
        self.model, self.tokenizer = load_model_and_tokenizer(model, *loaded)
        # The draft model loads as `generate --assistant-model` loads it (models/loading.py).
        self.assistant_model = (
            None if assistant_model is None else load_model_and_tokenizer(assistant_model, *loaded)[0]
        )
        if chat_template is not None:
            self.tokenizer.chat_template = chat_template
        eos_token_id, pad_token_id = special_ids(self.model, self.tokenizer)
        self.generation_config = greedy_generation_config(eos_token_id, pad_token_id, generation_config)
        self.cb_config = ContinuousBatchingConfig(
            **{"return_logprobs": return_logprobs, **(continuous_batching_config or {})}
        )
        self.eos_ids = eos_set(self.generation_config.eos_token_id)
        self.prompt_column = prompt_column
        self.prompt_format = PromptFormat(chat=apply_chat_template, system_prompt=system_prompt)
        self.max_new_tokens = max_new_tokens
        self.return_logprobs = return_logprobs
        self.detokenize = detokenize
        self.batches_done = 0
        self.load_s = time.perf_counter() - started  # the actor's start cost (docs/scale_out.md)

    def __call__(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        columns = {name: _as_list(values) for name, values in batch.items()}
        num_rows = len(next(iter(columns.values()))) if columns else 0
        if num_rows == 0:
            return {**batch, **{name: _output_column([]) for name in OUTPUT_COLUMNS}}
        per_input = self._sampling_columns(columns, num_rows)
        token_lists = [self._prompt_ids(columns, row) for row in range(num_rows)]
        extra = {} if self.assistant_model is None else {"assistant_model": self.assistant_model}
        outputs = generate_rows(
            self.model,
            token_lists,
            self.generation_config,
            self.cb_config,
            False,
            per_input=per_input,
            persistent_manager=True,  # one engine per actor: its cache is built once, reused per batch
            **extra,
        )
        limits = per_input["max_new_tokens"]
        result = dict(batch)  # the input columns pass through as Ray Data gave them
        result.update(self._output_columns(outputs, limits))
        self.batches_done += 1
        return result

    def _sampling_columns(self, columns: dict[str, list[Any]], num_rows: int) -> dict[str, list[Any]]:
        per_input = {
            name: [_scalar(v) for v in columns[name]] for name in SAMPLING_COLUMNS if name in columns
        }
        per_input["max_new_tokens"] = [
            self.max_new_tokens if v is None else int(v)
            for v in per_input.get("max_new_tokens", [None] * num_rows)
        ]
        vector = sorted(set(per_input) & set(VECTOR_PARAMS))
        if vector and not self.cb_config.per_request_processors:
            raise ValueError(
                f"columns {vector} set per-row sampling: build CBPredictor with "
                "continuous_batching_config={'per_request_processors': True}"
            )
        return per_input

    def _prompt_ids(self, columns: dict[str, list[Any]], row: int) -> list[int]:
        if TOKEN_IDS_COLUMN in columns and columns[TOKEN_IDS_COLUMN][row] is not None:
            return [int(t) for t in _as_list(columns[TOKEN_IDS_COLUMN][row])]
        if MESSAGES_COLUMN in columns and columns[MESSAGES_COLUMN][row] is not None:
            return self._chat_ids([dict(m) for m in _as_list(columns[MESSAGES_COLUMN][row])])
        if self.prompt_column not in columns:
            raise ValueError(
                f"the batch has no prompt column: expected {self.prompt_column!r}, {MESSAGES_COLUMN!r} or "
                f"{TOKEN_IDS_COLUMN!r}, got {sorted(columns)}"
            )
        text = str(columns[self.prompt_column][row])
        try:
            return prompt_ids(self.tokenizer, text, self.prompt_format)
        except NoChatTemplate:
            raise ValueError(NO_TEMPLATE) from None

    def _chat_ids(self, messages: list[dict[str, object]]) -> list[int]:
        try:
            return chat_ids(self.tokenizer, messages)  # a chat the model answers: with the generation prompt
        except NoChatTemplate:
            raise ValueError(NO_TEMPLATE) from None

    def _output_columns(self, outputs: Sequence[JobOutput], limits: Sequence[int]) -> dict[str, np.ndarray]:
        rows = []
        for output, limit in zip(outputs, limits, strict=True):
            tokens = [int(t) for t in output.generated_tokens]
            created = getattr(output, "created_time", None)
            first, finish = getattr(output, "first_token_time", None), getattr(output, "finish_time", None)
            row = {
                "generated_text": (
                    self.tokenizer.decode(tokens, skip_special_tokens=True) if self.detokenize else None
                ),
                "generated_token_ids": tokens,
                "finish_reason": finish_reason(output, limit, self.eos_ids),
                "status": status_name(output.status),
                "error": getattr(output, "error", None),
                "num_prompt_tokens": len(output.prompt_ids),
                "num_generated_tokens": len(tokens),
                "ttft_s": None if created is None or first is None else first - created,
                "latency_s": None if created is None or finish is None else finish - created,
            }
            if self.return_logprobs:
                row[LOGPROBS_COLUMN] = [float(x) for x in (getattr(output, "logprobs", None) or [])]
            rows.append(row)
        return {name: _output_column([row[name] for row in rows]) for name in rows[0]}


def _as_list(values: Any) -> list[Any]:
    """A column (numpy array, Arrow-backed list, tuple) or a ragged cell as a Python list."""
    if isinstance(values, np.ndarray):
        return list(values)
    if hasattr(values, "to_pylist"):
        return values.to_pylist()
    return list(values)


def _scalar(value: Any) -> Any:
    """A numpy scalar as a Python one; None / NaN (a missing value of a numeric column) as None."""
    if value is None:
        return None
    if isinstance(value, np.ndarray):
        return [_scalar(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def _output_column(values: list[Any]) -> np.ndarray:
    """One output column; ragged lists (token ids) stay one list per row instead of a 2-D array."""
    if values and isinstance(values[0], (list, np.ndarray)):
        column = np.empty(len(values), dtype=object)
        for i, value in enumerate(values):  # a slice assignment would broadcast equal-length lists
            column[i] = value
        return column
    return np.asarray(values, dtype=object if any(v is None for v in values) else None)
