"""Per-request sampling parameters: their defaults from the `GenerationConfig`, and the one
function that validates the keyword arguments a caller passes per request.

The per-request names are transformers' own (`add_request(..., **logit_processor_kwargs)`):
`temperature`, `top_k`, `top_p`, `min_p`, `repetition_penalty`, `seed`, `stop_strings`, `do_sample`,
OpenAI's `presence_penalty`, `frequency_penalty`, `logit_bias` and `min_tokens` (sampling/logits/openai.py),
plus the output options `return_logprobs`, `top_logprobs` and `prompt_logprobs` and the output
constraint `guided` (guided.py). See docs/sampling.md.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from transformers import GenerationConfig

from ..config.draft_settings import SPECULATION_KWARGS
from .neutral import NEUTRAL_VALUES
from .structured.guided import GuidedDecoding, as_guided

# Processors whose value may differ per request (vectorized over the step's rows).
VECTOR_PARAMS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p")
# Per-request options that are not processors: they never need the GenerationConfig to enable them.
REQUEST_OPTIONS = ("seed", "stop_strings", "do_sample")
# OpenAI's processors: no GenerationConfig field creates them, so they need only the flag.
OPENAI_PARAMS = ("presence_penalty", "frequency_penalty", "logit_bias", "min_tokens")
OUTPUT_OPTIONS = ("return_logprobs", "top_logprobs", "prompt_logprobs")
# What the output must match (docs/structured_outputs.md); needs a tokenizer, not the flag.
CONSTRAINT_OPTIONS = ("guided",)
# Speculation (config/draft_settings.py) rides with the per-request kwargs; the engine takes it out before
# the sampling parameters are resolved (`resolve_request_params` leaves it alone).
PER_REQUEST_KWARGS = (
    *VECTOR_PARAMS,
    *REQUEST_OPTIONS,
    *OPENAI_PARAMS,
    *OUTPUT_OPTIONS,
    *CONSTRAINT_OPTIONS,
    *SPECULATION_KWARGS,
)
WARPER_PARAMS = ("temperature", "top_k", "top_p", "min_p")  # applied only to rows that sample


@dataclass(frozen=True)
class SamplingParams:
    """What one request samples with. The processors' defaults are their neutral values (neutral.py),
    which leave the logits unchanged."""

    temperature: float = NEUTRAL_VALUES["temperature"]
    top_k: int = NEUTRAL_VALUES["top_k"]
    top_p: float = NEUTRAL_VALUES["top_p"]
    min_p: float = NEUTRAL_VALUES["min_p"]
    repetition_penalty: float = NEUTRAL_VALUES["repetition_penalty"]
    seed: int | None = None
    stop_strings: tuple[str, ...] = ()
    do_sample: bool = False
    presence_penalty: float = NEUTRAL_VALUES["presence_penalty"]
    frequency_penalty: float = NEUTRAL_VALUES["frequency_penalty"]
    logit_bias: tuple[tuple[int, float], ...] = NEUTRAL_VALUES["logit_bias"]  # (token id, bias), sorted by id
    min_tokens: int = NEUTRAL_VALUES["min_tokens"]
    return_logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: bool = False
    guided: GuidedDecoding | None = None

    @property
    def uses_openai_processors(self) -> bool:
        return any(getattr(self, name) != NEUTRAL_VALUES[name] for name in OPENAI_PARAMS)

    @property
    def changes_logits(self) -> bool:
        """True when some vector or OpenAI processor changes this request's row."""
        vector = any(getattr(self, name) != NEUTRAL_VALUES[name] for name in VECTOR_PARAMS)
        return vector or self.uses_openai_processors


NEUTRAL = SamplingParams()


def enabled_vector_params(config: GenerationConfig, all_request_stages: bool = False) -> set[str]:
    """The vectorized processors `generate()` would build for `config` (the documents' rule: a
    processor exists only when its GenerationConfig value is non-default). `all_request_stages`: every
    one, whatever `config` says (an engine whose requests each bring their own values, the server's)."""
    if all_request_stages:
        return set(VECTOR_PARAMS)
    enabled = set()
    neutral = NEUTRAL_VALUES
    if config.repetition_penalty is not None and config.repetition_penalty != neutral["repetition_penalty"]:
        enabled.add("repetition_penalty")
    if config.do_sample:
        if config.temperature is not None and config.temperature != neutral["temperature"]:
            enabled.add("temperature")
        if config.top_k is not None and config.top_k != neutral["top_k"]:
            enabled.add("top_k")
        if config.top_p is not None and config.top_p < neutral["top_p"]:
            enabled.add("top_p")
        if config.min_p is not None:  # transformers builds min-p for any value, its neutral 0.0 included
            enabled.add("min_p")
    return enabled


def default_params(
    config: GenerationConfig,
    return_logprobs: bool,
    top_logprobs: int,
    prompt_logprobs: bool,
    all_request_stages: bool = False,
) -> SamplingParams:
    """The parameters of a request that overrides nothing: the processors' values from `config` where it
    creates the processor, else neutral; with `all_request_stages`, neutral (the config's are not used)."""
    enabled = set() if all_request_stages else enabled_vector_params(config)
    stop_strings = config.stop_strings
    if isinstance(stop_strings, str):
        stop_strings = [stop_strings]
    neutral = NEUTRAL_VALUES

    def value(name: str) -> Any:
        return getattr(config, name) if name in enabled else neutral[name]

    return SamplingParams(
        temperature=float(value("temperature")),
        top_k=int(value("top_k")),
        top_p=float(value("top_p")),
        min_p=float(value("min_p")),
        repetition_penalty=float(value("repetition_penalty")),
        stop_strings=tuple(stop_strings or ()),
        return_logprobs=return_logprobs or top_logprobs > 0,
        top_logprobs=top_logprobs,
        prompt_logprobs=prompt_logprobs,
        do_sample=bool(config.do_sample),
    )


def check_config_values(params: SamplingParams, config: GenerationConfig) -> None:
    """The GenerationConfig's own values of the vectorized processors, checked like per-request ones."""
    for name in enabled_vector_params(config):
        _checked(name, getattr(params, name), "GenerationConfig")


def _number(name: str, value: object, label: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{label}: {name} must be a number, got {value!r}")
    return float(value)


def _int(name: str, value: object, label: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{label}: {name} must be an int, got {value!r}")
    return value


def _checked(name: str, value: Any, label: str) -> Any:
    """`value` of per-request option `name`, normalized, or `ValueError` naming `label`."""
    if name == "temperature":
        value = _number(name, value, label)
        ok = value > 0
    elif name == "top_k":
        value = _int(name, value, label)
        ok = value >= 0
    elif name in ("top_p", "min_p"):
        value = _number(name, value, label)
        ok = 0.0 <= value <= 1.0 and (name == "min_p" or value > 0)
    elif name == "repetition_penalty":
        value = _number(name, value, label)
        ok = value > 0
    elif name == "seed":
        ok = True
        value = _int(name, value, label)
    elif name == "stop_strings":
        value = [value] if isinstance(value, str) else value
        ok = isinstance(value, (list, tuple)) and all(isinstance(s, str) and s for s in value)
        value = tuple(value) if ok else value
    elif name == "guided":
        return as_guided(value, label)
    elif name == "top_logprobs":
        value = _int(name, value, label)
        ok = value >= 0
    elif name in ("presence_penalty", "frequency_penalty"):
        value = _number(name, value, label)
        ok = -2.0 <= value <= 2.0  # OpenAI's range
    elif name == "logit_bias":
        value, ok = _logit_bias(value)
    elif name == "min_tokens":
        value = _int(name, value, label)
        ok = value >= 0
    else:  # return_logprobs, prompt_logprobs, do_sample
        ok = isinstance(value, bool)
    if not ok:
        raise ValueError(f"{label}: invalid {name}={value!r} (see docs/sampling.md for the allowed range)")
    return value


def _logit_bias(value: object) -> tuple[object, bool]:
    """`{token_id: bias}` (int keys, or the digit strings JSON gives) as sorted pairs; biases in
    OpenAI's [-100, 100]."""
    if not isinstance(value, dict):
        return value, False
    pairs = []
    for key, bias in value.items():
        token = int(key) if isinstance(key, str) and key.isdigit() else key
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            return value, False
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            return value, False
        pairs.append((token, float(bias)))
    return tuple(sorted(pairs)), True


def resolve_request_params(
    base: SamplingParams,
    kwargs: Mapping[str, object],
    config: GenerationConfig,
    per_request_processors: bool,
    label: str,
    all_request_stages: bool = False,
) -> SamplingParams:
    """`base` with the caller's per-request `kwargs` applied (None values mean "not given").

    Raises `ValueError` naming `label` for an unknown name, a bad value, a processor parameter
    without `per_request_processors=True`, or one whose processor the GenerationConfig does not
    create (as in transformers, set the GenerationConfig value to a non-default one first; an engine
    with `all_request_stages` creates every one)."""
    given = {
        name: value for name, value in kwargs.items() if value is not None and name not in SPECULATION_KWARGS
    }
    if not given:
        return base
    unknown = sorted(set(given) - set(PER_REQUEST_KWARGS))
    if unknown:
        raise ValueError(
            f"{label}: unknown per-request parameter(s) {unknown}; supported: {list(PER_REQUEST_KWARGS)}"
        )
    needs_flag = sorted(set(given) - set(OUTPUT_OPTIONS) - set(CONSTRAINT_OPTIONS))
    if needs_flag and not per_request_processors:
        raise ValueError(
            f"{label}: per-request {needs_flag} need ContinuousBatchingConfig(per_request_processors=True)"
        )
    enabled = enabled_vector_params(config, all_request_stages)
    for name in given:
        if name in VECTOR_PARAMS and name not in enabled:
            why = (
                "do_sample=False" if name != "repetition_penalty" and not config.do_sample else "its default"
            )
            raise ValueError(
                f"{label}: per-request {name} needs the GenerationConfig to create the {name} processor, but "
                f"it has {why} (GenerationConfig.{name}={getattr(config, name)!r}); set a non-default "
                f"{name} in the GenerationConfig (requests may still use the neutral value)"
            )
    changes = {name: _checked(name, value, label) for name, value in given.items()}
    params = replace(base, **changes)
    if params.top_logprobs > 0 and not params.return_logprobs:
        params = replace(params, return_logprobs=True)
    if not params.do_sample:
        # As `generate(do_sample=False)`: no sampling warper is built for a greedy request.
        params = replace(params, **{name: NEUTRAL_VALUES[name] for name in WARPER_PARAMS})
    return params


def derive_seed(config_seed: int, request_id: str) -> int:
    """A request's own seed from the config's seed and its id: independent of the batch."""
    digest = hashlib.sha256(f"{config_seed}:{request_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)
