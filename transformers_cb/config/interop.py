"""Accepting transformers' own continuous-batching objects as inputs.

The documents build their settings with transformers' classes
(`transformers.generation.ContinuousBatchingConfig`, `WorkloadHints`), and real
clients (`transformers serve`, TRL's trainers) pass them straight in. They are
converted here, field by field, into ours, so our validation and our error
messages apply. Only what the user set is carried over: the two config classes
have different defaults, and transformers' "0 = auto" values mean "our default".
`take_cb_config` also takes the deprecated `GenerationConfig.continuous_batching_config`.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any

from transformers import GenerationConfig

from .continuous_batching import ContinuousBatchingConfig

# transformers' fields whose value means "pick for me" when it is one of these: not carried over.
_AUTO_VALUES: dict[str, tuple[object, ...]] = {
    "q_padding_interval_size": (0,),
    "kv_padding_interval_size": (0,),
}
# Deprecated fields transformers has already folded into their replacement in its __post_init__
# (block_size -> page_size, use_default_compile_configs -> default_compile_level): carrying them would
# warn a second time for nothing. max_cached_graphs (warned by transformers) is set without a second warning.
_FOLDED = ("block_size", "use_default_compile_configs", "max_cached_graphs")

_OUR_FIELDS = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}


def _is_transformers_object(obj: object, class_name: str) -> bool:
    cls = type(obj)
    return cls.__name__ == class_name and cls.__module__.startswith("transformers.")


def _explicit_fields(obj: object) -> dict[str, object]:
    """The dataclass fields of `obj` whose value differs from its class's default."""
    if not dataclasses.is_dataclass(obj):
        return {k: v for k, v in vars(obj).items() if not k.startswith("_")}
    explicit = {}
    for f in dataclasses.fields(obj):
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = dataclasses.MISSING
        value = getattr(obj, f.name)
        if default is dataclasses.MISSING or value != default or type(value) is not type(default):
            explicit[f.name] = value
    return explicit


def from_transformers_config(config: object) -> ContinuousBatchingConfig:
    """Our `ContinuousBatchingConfig` equivalent to transformers' one.

    Raises:
        ValueError: a field set on `config` that ours does not know (named), or an invalid value
            (our validation's message).
    """
    carried: dict[str, Any] = {}
    for name, value in _explicit_fields(config).items():
        if name in _FOLDED or value in _AUTO_VALUES.get(name, ()):
            continue
        if name not in _OUR_FIELDS:
            raise ValueError(
                f"transformers' ContinuousBatchingConfig.{name}={value!r} is not supported by transformers_cb "
                f"(known fields: {sorted(_OUR_FIELDS - set(_FOLDED))})"
            )
        carried[name] = value
    ours = ContinuousBatchingConfig(**carried)
    graphs = getattr(config, "max_cached_graphs", None)
    if graphs is not None:
        ours.max_cached_graphs = graphs
        ours.validate()
    return ours


def as_cb_config(
    config: object, argument: str = "continuous_batching_config"
) -> ContinuousBatchingConfig | None:
    """Ours as is; transformers' converted; a dict as keyword arguments; None stays None."""
    if config is None or isinstance(config, ContinuousBatchingConfig):
        return config
    if isinstance(config, dict):
        return ContinuousBatchingConfig(**config)
    if _is_transformers_object(config, "ContinuousBatchingConfig"):
        return from_transformers_config(config)
    raise TypeError(
        f"{argument} must be a transformers_cb or transformers ContinuousBatchingConfig (or a dict), "
        f"got {type(config).__name__}"
    )


def take_cb_config(
    generation_config: GenerationConfig | None, continuous_batching_config: object
) -> ContinuousBatchingConfig | None:
    """The config to run with: ours, or transformers' converted into ours (`as_cb_config`).

    The deprecated `GenerationConfig.continuous_batching_config` still works, with a FutureWarning;
    an explicit `continuous_batching_config` wins and the nested one is then neither used nor validated.
    """
    legacy = getattr(generation_config, "continuous_batching_config", None) if generation_config else None
    if legacy is None:
        return as_cb_config(continuous_batching_config)
    warnings.warn(
        "Setting continuous_batching_config on GenerationConfig is deprecated; pass "
        "continuous_batching_config= to generate_batch / init_continuous_batching instead",
        FutureWarning,
        stacklevel=3,
    )
    if continuous_batching_config is not None:
        return as_cb_config(continuous_batching_config)
    return as_cb_config(legacy, "GenerationConfig.continuous_batching_config")


@dataclass(frozen=True)
class WorkloadHints:
    """What the caller expects to submit; sizes the cache and block tables. 0 means unknown.

    transformers' `WorkloadHints` (same fields) is accepted wherever this one is.
    """

    max_prompt_length: int = 0
    max_generated_length: int = 0
    num_requests: int = 0

    def workload(self) -> list[int] | None:
        """The KV length of each expected request, as `resolve_sizing` takes it; None when unknown."""
        length = self.max_prompt_length + self.max_generated_length
        if self.num_requests <= 0 or self.max_prompt_length <= 0 or self.max_generated_length <= 0:
            return None
        return [length] * self.num_requests


def as_workload_hints(hints: object) -> WorkloadHints | None:
    if hints is None or isinstance(hints, WorkloadHints):
        return hints
    if isinstance(hints, dict):
        values = hints
    elif all(hasattr(hints, name) for name in ("max_prompt_length", "max_generated_length", "num_requests")):
        values = {f.name: getattr(hints, f.name) for f in dataclasses.fields(WorkloadHints)}
    else:
        raise TypeError(f"workload_hints must be a WorkloadHints, got {type(hints).__name__}")
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"WorkloadHints.{name}={value!r} is invalid: allowed an int >= 0")
    return WorkloadHints(**values)
