"""One `generate_batch` run of the conformance check under one setting, and what it counted
(`SettingResult`); shared by the text check (check.py) and the check with images (media_check.py)."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import GenerationConfig, PreTrainedModel

from ..api.generate_batch import CACHED_ENGINE_ATTR, batch_generating
from ..config.continuous_batching import ContinuousBatchingConfig
from ..requests import GenerationOutput


@dataclass
class SettingResult:
    name: str
    num_requests: int = 0
    num_match: int = 0
    num_near_ties: int = 0
    num_failed: int = 0  # mismatches that are not near-ties, and requests that did not finish
    num_preemptions: int = 0
    seconds: float = 0.0
    details: list[str] | None = None

    @property
    def passed(self) -> bool:
        return self.num_failed == 0


# Keys of a setting that are `generate_batch` keywords rather than `ContinuousBatchingConfig` fields.
GENERATE_KWARGS = ("prompt_lookup_num_tokens", "assistant_model")


def generate_batch_counting_preemptions(
    model: PreTrainedModel,
    prompts: list[list[int]],
    generation_config: GenerationConfig,
    cb_config: ContinuousBatchingConfig,
    **generate_kwargs: object,
) -> tuple[dict[str, GenerationOutput], int]:
    """`model.generate_batch(prompts)` and the preemptions its engine counted (`Engine.snapshot()`).

    The call keeps its engine on the model (`persistent_manager=True`) so that its count can be read
    afterwards; it starts with no engine cached, so the engine and its count are this call's own, and
    whatever the model held before is put back."""
    held = getattr(model, CACHED_ENGINE_ATTR, None)
    if held is not None:
        delattr(model, CACHED_ENGINE_ATTR)
    try:
        # The plugin installs `generate_batch` (api/generate_batch.py) on the model classes at run time.
        outputs = batch_generating(model).generate_batch(
            prompts,
            generation_config=generation_config,
            continuous_batching_config=cb_config,
            progress_bar=False,
            persistent_manager=True,
            **generate_kwargs,
        )
        _, engine = getattr(model, CACHED_ENGINE_ATTR)
        return outputs, engine.snapshot().preemptions
    finally:
        if held is not None:
            setattr(model, CACHED_ENGINE_ATTR, held)
        elif hasattr(model, CACHED_ENGINE_ATTR):
            delattr(model, CACHED_ENGINE_ATTR)
