"""The one table of neutral values: for each sampling option and `GenerationConfig` field, the value at
which it changes nothing (the logits, or the decoding mode, stay as they are).

Every place that asks "is this value neutral?" reads `NEUTRAL_VALUES`: a request's defaults
(`params.SamplingParams`), which vectorized processors a `GenerationConfig` creates
(`params.enabled_vector_params`), the sampler's skip of a stage whose rows are all neutral, the server's
request fields (`serve/protocol.py`'s `ENGINE_FIELDS`), and `check_generation_config`, which refuses a
field set away from its default that the engine does not implement (config/generation_fields.py
classifies the fields).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from transformers import GenerationConfig

from ..config import generation_fields as fields

NEUTRAL_VALUES: Mapping[str, Any] = MappingProxyType(
    {
        # The per-request processors (warpers.py, openai.py); `SamplingParams` defaults to these.
        "temperature": 1.0,
        "top_k": 0,  # 0: off (transformers builds no top-k warper for it)
        "top_p": 1.0,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "logit_bias": (),  # (token id, bias) pairs: none
        "min_tokens": 0,
        # GenerationConfig fields whose "off" is a value besides None and transformers' own default.
        "min_length": 0,
        "min_new_tokens": 0,
        "num_beams": 1,
        "num_beam_groups": 1,
        "num_return_sequences": 1,
        "diversity_penalty": 0.0,
        "penalty_alpha": 0.0,
        "encoder_repetition_penalty": 1.0,
        "typical_p": 1.0,
        "epsilon_cutoff": 0.0,
        "eta_cutoff": 0.0,
        "no_repeat_ngram_size": 0,
        "encoder_no_repeat_ngram_size": 0,
        "guidance_scale": 1.0,
        "renormalize_logits": False,
        "remove_invalid_values": False,
        "token_healing": False,
        "use_mtp": False,
    }
)

_ABSENT = object()


def is_neutral(name: str, value: object) -> bool:
    """`value` is the neutral value of `name` (False for a name without one)."""
    neutral = NEUTRAL_VALUES.get(name, _ABSENT)
    return neutral is not _ABSENT and value == neutral


def is_default(name: str, value: object) -> bool:
    """A `GenerationConfig` value that leaves field `name` off: None, transformers' default, or neutral."""
    if value is None or value == fields.transformers_defaults().get(name, None):
        return True
    return is_neutral(name, value)


def check_generation_config(config: GenerationConfig) -> None:
    """Raise `UnsupportedGenerationOption` naming the first field set away from its default that is
    neither implemented nor harmless (refused, or unknown to this release)."""
    for name in fields.field_names():
        value = getattr(config, name, None)
        if name in fields.IMPLEMENTED or name in fields.HARMLESS or is_default(name, value):
            continue
        known = (
            "is not implemented by transformers_cb"
            if name in fields.REFUSED
            else "is unknown to transformers_cb"
        )
        raise fields.UnsupportedGenerationOption(
            f"GenerationConfig.{name}={value!r} {known}; it would be ignored, so it is refused "
            f"(leave it at its default, {fields.transformers_defaults().get(name)!r})"
        )
