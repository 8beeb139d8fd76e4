"""A submission made a `Request`: its prompt, limits, eos ids, sampling, speculation and siblings
checked against the engine (its model's shape, its cache, its generation config), every error a
`ValueError` naming the input it is about (validation.py's checks).

`RequestBuilder` is one of the engine's parts, wired in build.py from the plan and the parts it asks
(the sampling setup, the engine's speculation, the device tier's pages), and called as
`engine.build_request(...)`; it knows nothing of the engine itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transformers import GenerationConfig

from ..config.draft_settings import split_speculation_kwargs
from ..config.generation_fields import default_max_new_tokens
from ..kv.page_manager import PageManager
from ..memory.sizing import ModelShape
from ..requests import Request
from ..sampling.request_state import SamplingSetup
from ..scheduler.media_budget import MediaBudget
from .draft_setup import EngineSpeculation
from .media_inputs import MediaIntake
from .siblings import add_siblings, num_return_sequences_of
from .validation import as_eos_token_ids, as_max_new_tokens, as_max_staleness, as_token_ids


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

    def __call__(
        self,
        input_ids: Any,
        request_id: str,
        max_new_tokens: int | None = None,
        eos_token_id: int | list[int] | None = None,
        streaming: bool = False,
        label: str | None = None,
        record_timestamps: bool = False,
        sampling_kwargs: dict[str, Any] | None = None,
        num_return_sequences: int | None = None,
        max_staleness: int | None = None,
    ) -> Request:
        """Validate one submission into a `Request`. Raises `ValueError` naming `label` on bad input.

        `sampling_kwargs`: per-request parameters (`temperature`, `top_k`, `seed`, `stop_strings`,
        `top_logprobs`, ...; see sampling/params.py), None values meaning "not given".
        `num_return_sequences` (default: the generation config's): with n > 1 the request carries
        n - 1 siblings (`siblings`, forked from `fork_children`), ids `f"{request_id}__child#{i}"`; `request.family` lists all.
        `max_staleness`: the most weight versions the request's KV may lag behind the model's before it is
        recomputed (None: any; docs/manager.md, "Weight updates").
        Media (`pixel_values`, `image_sizes`, `image_grid_thw`, `pixel_values_videos`, `input_features`,
        ... whatever the model's processor returns for this prompt) come in `sampling_kwargs` too."""
        label = label or f"request {request_id!r}"
        staleness = as_max_staleness(max_staleness, label)
        prompt = as_token_ids(input_ids, label, self.shape.vocab_size)
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
        if eos_token_id is None:
            eos_token_id = self.generation_config.eos_token_id
        request = Request(
            request_id=request_id,
            prompt_ids=prompt,
            max_new_tokens=max_new_tokens,
            eos_token_ids=as_eos_token_ids(eos_token_id, label),
            streaming=streaming,
            record_timestamps=record_timestamps,
        )
        media_model = self.media if self.media is not None else MediaIntake("text")
        media_kwargs, sampling_kwargs = media_model.split(sampling_kwargs)
        request.media = media_model.build(prompt, media_kwargs, label)
        if request.media is not None and self.media_budget is not None:
            reason = self.media_budget.unfittable_reason(request.media.num_rows, request.media.blocks)
            if reason is not None:
                raise ValueError(f"{label}: {reason}")
        speculation_kwargs, sampling_kwargs = split_speculation_kwargs(sampling_kwargs)
        self.sampling.attach(request, sampling_kwargs, label)
        self.speculation.attach(request, speculation_kwargs, label)
        reason = self.pages.unfittable_reason(request.max_total_tokens)
        if reason is not None:
            raise ValueError(f"{label}: {reason}; raise num_blocks or lower max_new_tokens")
        count = num_return_sequences_of(num_return_sequences, self.generation_config, label)
        add_siblings(request, count, self.sampling, sampling_kwargs, label)
        for sibling in request.siblings:  # each with its own draft length and counts
            self.speculation.attach(sibling, speculation_kwargs, label)
        for member in request.family:
            member.max_staleness = staleness
        return request
