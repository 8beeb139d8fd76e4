"""`SamplingSettings`: how one engine's requests are sampled, resolved once at start (part of the
`EngineSettings`, engine/settings.py): the generation config every request starts from, resolved and checked,
and the logprob and processor settings the `SamplingSetup` is built with."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import GenerationConfig, PreTrainedModel

from ..config.continuous_batching import ContinuousBatchingConfig
from ..config.generation_fields import ResolvedConfig, resolve_generation_config
from .neutral import check_generation_config


@dataclass(frozen=True)
class SamplingSettings:
    """`generation_config`: the defaults of every request (a resolved copy); `all_request_stages`: every
    per-request processor stage built, neutral unless a request gives a value (the server's engine)."""

    generation_config: GenerationConfig
    per_request_processors: bool
    return_logprobs: bool
    top_logprobs: int
    prompt_logprobs: bool
    seed: int | None
    all_request_stages: bool = False


def resolve_sampling_settings(
    model: PreTrainedModel,
    generation_config: GenerationConfig | ResolvedConfig | None,
    config: ContinuousBatchingConfig,
    all_request_stages: bool = False,
) -> SamplingSettings:
    """The generation config resolved for `model` (`resolve_generation_config`) and checked (raises for a
    field this package does not implement), with `config`'s sampling settings."""
    generation = resolve_generation_config(model, generation_config)
    check_generation_config(generation)
    return SamplingSettings(
        generation_config=generation,
        per_request_processors=config.per_request_processors,
        return_logprobs=config.return_logprobs,
        top_logprobs=config.top_logprobs,
        prompt_logprobs=config.prompt_logprobs,
        seed=config.seed,
        all_request_stages=all_request_stages,
    )
