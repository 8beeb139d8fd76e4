"""Which draft source each request speculates with, and whether an engine can speculate at all
(docs/speculative_decoding.md), decided once when it is built.

Speculation writes KV for draft tokens and takes the rejected ones back by rolling a request's token
count back: that needs every per-request state to be positional (paged KV). What cannot roll back, or
cannot carry several tokens per request and step, refuses speculation with the reason, which
`Engine.build_request` (per request) and the engine's start (a `GenerationConfig` that asks for it) raise
as a `ValueError`. Models with state layers (linear attention, state-space, short convolutions:
docs/state_layers.md) refuse: their recurrent state has absorbed the rejected tokens and cannot be
rolled back to the last accepted one.

`EngineSpeculation` holds the engine's answer, every request's defaults (the `GenerationConfig`'s
prompt lookup, the draft model's settings) and the engine's draft sources (scheduler/speculation/drafts.py: prompt
lookup; the draft model's, scheduler/speculation/shadow_planner.py), and gives each request its own settings and
source (`attach`).
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import GenerationConfig, PreTrainedModel

from ...config.draft_settings import (
    DEFAULT_MAX_NGRAM,
    AssistantSettings,
    LookupSettings,
    assistant_from_configs,
    lookup_from_config,
    request_assistant,
    request_lookup,
)
from ...distributed.sharding import tp_size_of
from ...invariants import present
from ...requests import Request
from ...scheduler.speculation.assisted import AssistantSchedule
from ...scheduler.speculation.back_off import SpeculationState
from ...scheduler.speculation.draft_source import DraftSource
from ...scheduler.speculation.prompt_lookup import PROMPT_LOOKUP


def speculation_refusal(model: PreTrainedModel, has_state_layers: bool = False) -> str | None:
    """Why an engine running `model` cannot speculate, or None when it can (`has_state_layers`: the
    model has state layers, model_check/state_probe.py)."""
    if has_state_layers:
        return (
            "speculative decoding (prompt_lookup_num_tokens) is not supported for models with state layers "
            "(linear attention, state-space, short convolutions): a recurrent state that has taken in "
            "rejected draft tokens cannot be rolled back"
        )
    if tp_size_of(model) > 1:
        return (
            "speculative decoding (prompt_lookup_num_tokens) is not supported under tensor parallelism "
            "(tp_size > 1): the other ranks replay one token per request and step"
        )
    return None


@dataclass
class EngineSpeculation:
    """One engine's speculation: why it cannot (`refusal`, None: it can), every request's defaults
    (`lookup`: the GenerationConfig's prompt lookup; `assistant`: the draft model's settings, None
    without `assistant_model`) and the draft model's source (`model_source`, None without one)."""

    refusal: str | None
    lookup: LookupSettings | None
    assistant: AssistantSettings | None
    model_source: DraftSource | None = None

    @property
    def sources(self) -> list[DraftSource]:
        """The engine's draft sources, each asked for its requests' drafts before every schedule."""
        return [PROMPT_LOOKUP] if self.model_source is None else [PROMPT_LOOKUP, self.model_source]

    @classmethod
    def for_engine(
        cls,
        refusal: str | None,
        generation_config: GenerationConfig,
        assistant_model: PreTrainedModel | None,
        model_source: DraftSource | None = None,
    ) -> EngineSpeculation:
        """Raises `ValueError` when the GenerationConfig asks for lookup, or an `assistant_model` is
        given, on an engine that cannot speculate. `model_source`: the draft model's source (with
        `assistant_model`)."""
        lookup = lookup_from_config(generation_config)
        if lookup is not None and refusal is not None:
            raise ValueError(f"GenerationConfig.prompt_lookup_num_tokens: {refusal}")
        assistant = None
        if assistant_model is not None:
            if refusal is not None:
                raise ValueError(f"assistant_model: {refusal}")
            assistant = assistant_from_configs(
                generation_config,
                getattr(assistant_model, "generation_config", None),
                "GenerationConfig (num_assistant_tokens)",
            )
        return cls(refusal, lookup, assistant, model_source if assistant_model is not None else None)

    def attach(self, request: Request, kwargs: dict[str, object], label: str) -> None:
        """The request's speculation (its own settings over the defaults), or a `ValueError` naming
        `label` when this engine cannot speculate. Prompt lookup, when set, wins over the draft model
        (as in `generate()`, which then builds a lookup candidate generator)."""
        settings = request_lookup(self.lookup, kwargs, label)
        assisted = request_assistant(self.assistant, kwargs, label)
        if settings is None and assisted is None:
            return
        if self.refusal is not None:
            raise ValueError(f"{label}: {self.refusal}")
        if settings is not None:
            request.speculation = SpeculationState(settings.num_tokens, PROMPT_LOOKUP, settings.max_ngram)
        elif assisted is not None:
            source = present(self.model_source, "an engine with draft-model settings has the draft model")
            schedule = AssistantSchedule(assisted.schedule, assisted.confidence, length=assisted.num_tokens)
            request.speculation = SpeculationState(
                assisted.num_tokens, source, DEFAULT_MAX_NGRAM, assistant=schedule
            )
