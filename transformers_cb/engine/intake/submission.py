"""A submission made a `Request`: its prompt, limits, eos ids, sampling, speculation and siblings
checked against the engine (its model's shape, its cache, its generation config), every error a
`ValueError` naming the input it is about (validation.py's checks).

Each entry point (`generate_batch`, the manager's `add_request(s)`, through it the server) turns its
caller's keyword arguments into one typed `Submission` through `make_submission`, the one place a
per-request kwargs bag is sorted by name (sampling, speculation, media); nothing below it splits a dict.

`RequestBuilder` is one of the engine's parts, wired in build.py from the settings and the parts it asks
(the sampling setup, the engine's speculation, the device tier's pages), and called as
`engine.build_request(submission)`; it knows nothing of the engine itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from transformers import GenerationConfig

from ...config.draft_settings import split_speculation_kwargs
from ...config.generation_fields import default_max_new_tokens
from ...kv.page_manager import PageManager
from ...memory.sizing import ModelShape
from ...requests import Request
from ...sampling.request_state import SamplingSetup
from ...scheduler.media_budget import MediaBudget
from ..speculation.draft_setup import EngineSpeculation
from ..weights.adapter_registry import UNSET, AdapterRegistry
from .media_inputs import MediaIntake
from .siblings import add_siblings, num_return_sequences_of
from .validation import as_eos_token_ids, as_max_new_tokens, as_max_staleness, as_token_ids

NOTHING: Mapping[str, object] = MappingProxyType({})


def _nothing() -> Mapping[str, object]:
    return NOTHING


@dataclass(frozen=True)
class Submission:
    """One request as an entry point hands it to the engine, each part in its own field.

    `sampling`: the per-request sampling parameters by name (sampling/params.py's `PER_REQUEST_KWARGS`
    less speculation's; `guided` included), None values meaning "not given"; `speculation`: the
    per-request speculation settings (config/draft_settings.py's `SPECULATION_KWARGS`); `media`: the
    processor's tensors for this prompt (`pixel_values`, `image_grid_thw`, ...). `num_return_sequences`
    None: the generation config's; `max_staleness` None: any (docs/manager.md, "Weight updates");
    `label`: how errors name the input (default `request '<id>'`)."""

    input_ids: object  # token ids (a list or a 1D tensor), checked by the builder
    request_id: str
    max_new_tokens: int | None = None
    eos_token_id: int | list[int] | None = None
    streaming: bool = False
    record_timestamps: bool = False
    label: str | None = None
    sampling: Mapping[str, object] = field(default_factory=_nothing)
    speculation: Mapping[str, object] = field(default_factory=_nothing)
    media: Mapping[str, object] = field(default_factory=_nothing)
    num_return_sequences: int | None = None
    max_staleness: int | None = None
    adapter: object = (
        UNSET  # a PEFT adapter's name, None: the base model, UNSET: the active one (docs/adapters.md)
    )


def make_submission(
    input_ids: object,
    request_id: str,
    per_request: Mapping[str, object] | None = None,
    media: Mapping[str, object] | None = None,
    *,
    max_new_tokens: int | None = None,
    eos_token_id: int | list[int] | None = None,
    streaming: bool = False,
    record_timestamps: bool = False,
    label: str | None = None,
    num_return_sequences: int | None = None,
    max_staleness: int | None = None,
    adapter: object = UNSET,
) -> Submission:
    """The `Submission` of one input. `per_request`: the caller's per-request keyword arguments less the
    media (which each entry point takes out with the model's `MediaIntake.split`, once), sorted here into
    speculation and sampling (everything else: an unknown name is refused by the sampling setup, naming
    it)."""
    speculation, sampling = split_speculation_kwargs(dict(per_request or {}))
    return Submission(
        input_ids,
        request_id,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_token_id,
        streaming=streaming,
        record_timestamps=record_timestamps,
        label=label,
        sampling=MappingProxyType(sampling),
        speculation=MappingProxyType(speculation),
        media=MappingProxyType({name: value for name, value in (media or {}).items() if value is not None}),
        num_return_sequences=num_return_sequences,
        max_staleness=max_staleness,
        adapter=adapter,
    )


@dataclass
class RequestBuilder:
    """Checks submissions against `shape` (vocabulary, positions), `generation_config` (defaults), the
    device tier's `pages` (a request that can never fit) and attaches each request's `sampling` and
    `speculation` state, and its media, checked against what the model takes (`media`: its feature
    methods and placeholders; `media_budget`: the embedding store, None when the model takes none)."""

    shape: ModelShape
    generation_config: GenerationConfig
    sampling: SamplingSetup
    speculation: EngineSpeculation
    pages: PageManager
    media: MediaIntake | None = None
    media_budget: MediaBudget | None = None
    adapters: AdapterRegistry | None = None  # the model's PEFT adapters (engine/weights/adapter_registry.py)

    def split_media(self, kwargs: Mapping[str, object] | None) -> tuple[dict[str, object], dict[str, Any]]:
        """(media, the rest) of one submission's per-request keyword arguments, by the model's media names
        (a text model: the known media prefixes, refused by name when built)."""
        return self._intake().split(kwargs)

    def _intake(self) -> MediaIntake:
        return self.media if self.media is not None else MediaIntake("text")

    def __call__(self, submission: Submission) -> Request:
        """Validate one submission into a `Request`. Raises `ValueError` naming its label on bad input.

        With `num_return_sequences` n > 1 the request carries n - 1 siblings (`siblings`, forked from
        `fork_children`), ids `f"{request_id}__child#{i}"`; `request.family` lists all."""
        label = submission.label or f"request {submission.request_id!r}"
        staleness = as_max_staleness(submission.max_staleness, label)
        choice = self.adapters.resolve(submission.adapter, label) if self.adapters is not None else None
        prompt = as_token_ids(submission.input_ids, label, self.shape.vocab_size)
        max_new_tokens = submission.max_new_tokens
        if max_new_tokens is None:
            max_new_tokens = default_max_new_tokens(self.generation_config, len(prompt))
            if max_new_tokens is None:
                raise ValueError(
                    f"{label}: no max_new_tokens given and the generation config has no max_length"
                )
        max_new_tokens = as_max_new_tokens(max_new_tokens, label)
        total = len(prompt) + max_new_tokens
        if total > self.shape.max_position_embeddings:
            raise ValueError(
                f"{label}: prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) = {total} exceeds "
                f"the model's max_position_embeddings ({self.shape.max_position_embeddings})"
            )
        eos_token_id = submission.eos_token_id
        if eos_token_id is None:
            eos_token_id = self.generation_config.eos_token_id
        request = Request(
            request_id=submission.request_id,
            prompt_ids=prompt,
            max_new_tokens=max_new_tokens,
            eos_token_ids=as_eos_token_ids(eos_token_id, label),
            streaming=submission.streaming,
            record_timestamps=submission.record_timestamps,
        )
        request.media = self._intake().build(prompt, dict(submission.media), label)
        if request.media is not None and self.media_budget is not None:
            reason = self.media_budget.unfittable_reason(request.media.num_rows, request.media.blocks)
            if reason is not None:
                raise ValueError(f"{label}: {reason}")
        sampling = dict(submission.sampling)
        speculation = dict(submission.speculation)
        self.sampling.attach(request, sampling, label)
        self.speculation.attach(request, speculation, label)
        reason = self.pages.unfittable_reason(request.max_total_tokens)
        if reason is not None:
            raise ValueError(f"{label}: {reason}; raise num_blocks or lower max_new_tokens")
        count = num_return_sequences_of(submission.num_return_sequences, self.generation_config, label)
        add_siblings(request, count, self.sampling, sampling, label)
        for sibling in request.siblings:  # each with its own draft length and counts
            self.speculation.attach(sibling, speculation, label)
        for member in request.family:
            member.max_staleness = staleness
            member.adapter = choice
        return request
