"""Speculation settings: prompt lookup (`prompt_lookup_num_tokens`, `max_matching_ngram_size`), with
`generate()`'s own names, from the `GenerationConfig` (every request's default) and per request.

Torch- and transformers-free (the scheduler reads `LookupSettings`): the `GenerationConfig` is read
through `getattr` only. Validation errors are `ValueError`s naming the input. See
docs/speculative_decoding.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

# The per-request keyword arguments of speculation (add_request, generate_batch, the server).
SPECULATION_KWARGS = ("prompt_lookup_num_tokens", "max_matching_ngram_size")
# transformers' default `max_matching_ngram_size` (PromptLookupCandidateGenerator) when only
# `prompt_lookup_num_tokens` is set.
DEFAULT_MAX_NGRAM = 2


@dataclass(frozen=True)
class LookupSettings:
    """Prompt lookup for one request: at most `num_tokens` draft tokens a step, copied from the first
    earlier occurrence of the sequence's last n-gram (n from `max_ngram` down to 1)."""

    num_tokens: int
    max_ngram: int = DEFAULT_MAX_NGRAM


def _positive_int(name: str, value: Any, label: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{label}: {name} must be an int >= {minimum}, got {value!r}")
    return value


def lookup_settings(num_tokens: Any, max_ngram: Any, label: str) -> LookupSettings | None:
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


def lookup_from_config(config: Any) -> LookupSettings | None:
    """Every request's default, from a `GenerationConfig` (`prompt_lookup_num_tokens` unset: none)."""
    return lookup_settings(
        getattr(config, "prompt_lookup_num_tokens", None),
        getattr(config, "max_matching_ngram_size", None),
        "GenerationConfig",
    )


def request_lookup(
    default: LookupSettings | None, kwargs: dict[str, Any], label: str
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


def split_speculation_kwargs(kwargs: dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(speculation kwargs, the others) of one request's per-request kwargs."""
    kwargs = kwargs or {}
    spec = {name: value for name, value in kwargs.items() if name in SPECULATION_KWARGS}
    rest = {name: value for name, value in kwargs.items() if name not in SPECULATION_KWARGS}
    return spec, rest
