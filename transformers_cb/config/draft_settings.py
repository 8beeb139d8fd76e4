"""Speculation settings, with `generate()`'s own names, from the `GenerationConfig` (every request's
default) and per request: prompt lookup (`prompt_lookup_num_tokens`, `max_matching_ngram_size`) and a
draft model's (`num_assistant_tokens`, `num_assistant_tokens_schedule`, `assistant_confidence_threshold`).

Torch- and transformers-free (the scheduler reads `LookupSettings`): the `GenerationConfig` is read
through `getattr` only. Validation errors are `ValueError`s naming the input. See
docs/speculative_decoding.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import cast

# The per-request keyword arguments of prompt lookup (add_request, generate_batch, the server).
LOOKUP_KWARGS = ("prompt_lookup_num_tokens", "max_matching_ngram_size")
# The per-request keyword arguments of a draft model (add_request, generate_batch; an engine with an
# `assistant_model`).
ASSISTANT_KWARGS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
# Every per-request keyword argument of speculation.
SPECULATION_KWARGS = (*LOOKUP_KWARGS, *ASSISTANT_KWARGS)
# transformers' `num_assistant_tokens_schedule` values (AssistedCandidateGenerator).
ASSISTANT_SCHEDULES = ("constant", "heuristic", "heuristic_transient")
# transformers' defaults (`GenerationConfig._get_default_generation_params`), which its assisted
# generation applies under the assistant model's own generation config.
DEFAULT_NUM_ASSISTANT_TOKENS = 20
DEFAULT_ASSISTANT_SCHEDULE = "constant"
DEFAULT_ASSISTANT_CONFIDENCE = 0.4
# transformers' default `max_matching_ngram_size` (PromptLookupCandidateGenerator) when only
# `prompt_lookup_num_tokens` is set.
DEFAULT_MAX_NGRAM = 2


@dataclass(frozen=True)
class LookupSettings:
    """Prompt lookup for one request: at most `num_tokens` draft tokens a step, copied from the first
    earlier occurrence of the sequence's last n-gram (n from `max_ngram` down to 1)."""

    num_tokens: int
    max_ngram: int = DEFAULT_MAX_NGRAM


def _positive_int(name: str, value: object, label: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{label}: {name} must be an int >= {minimum}, got {value!r}")
    return value


def lookup_settings(num_tokens: object, max_ngram: object, label: str) -> LookupSettings | None:
    """The settings of these two values (None: not given, or `num_tokens` 0: no speculation)."""
    if num_tokens is None:
        if max_ngram is not None:
            _positive_int("max_matching_ngram_size", max_ngram, label, 1)
        return None
    count = _positive_int("prompt_lookup_num_tokens", num_tokens, label, 0)
    ngram = (
        DEFAULT_MAX_NGRAM
        if max_ngram is None
        else _positive_int("max_matching_ngram_size", max_ngram, label, 1)
    )
    return LookupSettings(count, ngram) if count else None


def lookup_from_config(config: object) -> LookupSettings | None:
    """Every request's default, from a `GenerationConfig` (`prompt_lookup_num_tokens` unset: none)."""
    return lookup_settings(
        getattr(config, "prompt_lookup_num_tokens", None),
        getattr(config, "max_matching_ngram_size", None),
        "GenerationConfig",
    )


def request_lookup(
    default: LookupSettings | None, kwargs: Mapping[str, object], label: str
) -> LookupSettings | None:
    """A request's settings: its own `prompt_lookup_num_tokens` / `max_matching_ngram_size` (None values:
    not given) over `default`. `prompt_lookup_num_tokens=0` turns speculation off for the request."""
    num_tokens = kwargs.get("prompt_lookup_num_tokens")
    max_ngram = kwargs.get("max_matching_ngram_size")
    if num_tokens is None and max_ngram is None:
        return default
    if num_tokens is None:  # only the n-gram size: over the default's count, if any
        _positive_int("max_matching_ngram_size", max_ngram, label, 1)
        return None if default is None else LookupSettings(default.num_tokens, cast(int, max_ngram))
    if max_ngram is None and default is not None:
        max_ngram = default.max_ngram
    return lookup_settings(num_tokens, max_ngram, label)


def split_speculation_kwargs(
    kwargs: Mapping[str, object] | None,
) -> tuple[dict[str, object], dict[str, object]]:
    """(speculation kwargs, the others) of one request's per-request kwargs."""
    kwargs = kwargs or {}
    spec = {name: value for name, value in kwargs.items() if name in SPECULATION_KWARGS}
    rest = {name: value for name, value in kwargs.items() if name not in SPECULATION_KWARGS}
    return spec, rest


@dataclass(frozen=True)
class AssistantSettings:
    """A draft model for one request: at most `num_tokens` draft tokens a step, `schedule` one of
    `ASSISTANT_SCHEDULES` (how the draft length moves), drafting stopped after a token whose assistant
    probability is under `confidence` (0: never)."""

    num_tokens: int = DEFAULT_NUM_ASSISTANT_TOKENS
    schedule: str = DEFAULT_ASSISTANT_SCHEDULE
    confidence: float = DEFAULT_ASSISTANT_CONFIDENCE


def _schedule(value: object, label: str) -> str:
    if value not in ASSISTANT_SCHEDULES:
        raise ValueError(
            f"{label}: num_assistant_tokens_schedule must be one of {list(ASSISTANT_SCHEDULES)}, got {value!r}"
        )
    return value


def _confidence(value: object, label: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{label}: assistant_confidence_threshold must be a number in [0, 1], got {value!r}")
    return float(value)


def _set(config: object, name: str, default: object) -> object:
    """`config`'s value of `name` when set and not transformers' default, else None."""
    value = getattr(config, name, None) if config is not None else None
    return None if value is None or value == default else value


def assistant_from_configs(
    generation_config: object, assistant_config: object, label: str
) -> AssistantSettings:
    """Every request's draft-model settings: the engine's `GenerationConfig` where a field is set to other
    than transformers' default, else the assistant model's own generation config (where transformers'
    `AssistedCandidateGenerator` reads them), else transformers' defaults (20, "constant", 0.4)."""
    values = []
    for name, default in (
        ("num_assistant_tokens", DEFAULT_NUM_ASSISTANT_TOKENS),
        ("num_assistant_tokens_schedule", DEFAULT_ASSISTANT_SCHEDULE),
        ("assistant_confidence_threshold", DEFAULT_ASSISTANT_CONFIDENCE),
    ):
        value = _set(generation_config, name, default)
        if value is None:
            value = getattr(assistant_config, name, None) if assistant_config is not None else None
        values.append(default if value is None else value)
    num_tokens, schedule, confidence = values
    return AssistantSettings(
        _positive_int("num_assistant_tokens", num_tokens, label, 0),
        _schedule(schedule, label),
        _confidence(confidence, label),
    )


def request_assistant(
    default: AssistantSettings | None, kwargs: Mapping[str, object], label: str
) -> AssistantSettings | None:
    """A request's draft-model settings: its own `num_assistant_tokens` / `num_assistant_tokens_schedule` /
    `assistant_confidence_threshold` (None values: not given) over `default` (None: the engine has no
    assistant model, and giving any of them is a `ValueError`). `num_assistant_tokens=0` turns the draft
    model off for the request."""
    given = {name: kwargs[name] for name in ASSISTANT_KWARGS if kwargs.get(name) is not None}
    if default is None:
        if given:
            raise ValueError(
                f"{label}: {sorted(given)} need an assistant_model (none was given to the engine)"
            )
        return None
    settings = AssistantSettings(
        _positive_int(
            "num_assistant_tokens", given.get("num_assistant_tokens", default.num_tokens), label, 0
        ),
        _schedule(given.get("num_assistant_tokens_schedule", default.schedule), label),
        _confidence(given.get("assistant_confidence_threshold", default.confidence), label),
    )
    return settings if settings.num_tokens else None
