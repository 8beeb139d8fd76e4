"""The model methods that create, cache and drive `ContinuousBatchingManager`s."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase
from transformers.generation.logits_process import LogitsProcessor

from ..config.continuous_batching import ContinuousBatchingConfig
from ..config.interop import WorkloadHints, take_cb_config
from ..manager.lifecycle import CACHED_MANAGER_ATTR
from ..manager.manager import ContinuousBatchingManager
from ..runner.products.packed_model import release_packs
from .generate_batch import CACHED_ENGINE_ATTR

logger = logging.getLogger(__name__)

__all__ = [
    "CACHED_MANAGER_ATTR",
    "continuous_batching_context_manager",
    "destroy_cached_continuous_batching_manager",
    "init_continuous_batching",
]


def init_continuous_batching(
    self: PreTrainedModel,
    generation_config: GenerationConfig | None = None,
    continuous_batching_config: ContinuousBatchingConfig | Mapping[str, object] | object = None,
    workload_hints: WorkloadHints | Mapping[str, int] | object = None,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    logits_processor: Sequence[LogitsProcessor] | None = None,
    assistant_model: PreTrainedModel | None = None,
) -> ContinuousBatchingManager:
    """A manager for this model; call `start()` on it.

    As in transformers, a manager cached on the model (`stop(keep_for_next_session=True)`, or a
    context with `persistent_manager=True`) is returned instead of a new one; the arguments are then
    ignored. `destroy_cached_continuous_batching_manager()` drops it.

    Args:
        continuous_batching_config: ours or transformers' `ContinuousBatchingConfig`.
        workload_hints: `WorkloadHints` (ours or transformers'): the expected prompt and generated
            lengths and number of requests; they size the cache and the block tables.
        tokenizer: needed only for stop strings.
        logits_processor: the caller's own processors, applied to each request's own prompt +
            generated tokens (docs/sampling.md).
        assistant_model: a draft model for speculative decoding (`generate()`'s name): a small causal LM
            with the model's vocabulary, run on its own paged cache (docs/speculative_decoding.md).
    """
    cached = getattr(self, CACHED_MANAGER_ATTR, None)
    if cached is not None and not cached.is_destroyed:
        logger.info("reusing the continuous batching manager cached on the model")
        return cached
    cb_config = take_cb_config(generation_config, continuous_batching_config)
    return ContinuousBatchingManager(
        self,
        generation_config,
        cb_config,
        workload_hints=workload_hints,
        tokenizer=tokenizer,
        logits_processor=logits_processor,
        assistant_model=assistant_model,
    )


@contextmanager
def continuous_batching_context_manager(
    self: PreTrainedModel,
    generation_config: GenerationConfig | None = None,
    block: bool = True,
    timeout: float | None = None,
    continuous_batching_config: ContinuousBatchingConfig | Mapping[str, object] | object = None,
    persistent_manager: bool = False,
    warmup: bool = True,
    workload_hints: WorkloadHints | Mapping[str, int] | object = None,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    logits_processor: Sequence[LogitsProcessor] | None = None,
    assistant_model: PreTrainedModel | None = None,
) -> Iterator[ContinuousBatchingManager]:
    """Start a manager, yield it, then stop it (and destroy it unless `persistent_manager`).

    On exit, `block` / `timeout` bound the wait for queued and running requests whether or not the
    manager is persistent: with `block=False` the exit returns at once (the thread finishes the queue);
    with a `timeout`, what is still running then is hard-stopped (a non-persistent manager) or keeps
    running in the background (a persistent one).

    With `persistent_manager=True` the manager is cached on the model and reused by the next
    context (its configs are those of its first creation). With `warmup` a throw-away step runs
    before the manager starts (once per manager). If the block raises, the manager is hard-stopped
    so the exception is not held up by unfinished requests.
    """
    manager = init_continuous_batching(
        self,
        generation_config,
        continuous_batching_config,
        workload_hints,
        tokenizer=tokenizer,
        logits_processor=logits_processor,
        assistant_model=assistant_model,
    )
    if warmup:
        manager.warmup()
    manager.start()
    failed = False
    try:
        yield manager
    except BaseException:
        failed = True
        raise
    finally:
        manager.stop(block=block, timeout=timeout, keep_for_next_session=persistent_manager, hard_stop=failed)
        if not persistent_manager:
            # `stop` already waited as long as asked: a blocking exit hard-stops what is still running
            # (`timeout` passed), a non-blocking one leaves the thread to finish and release the cache.
            manager.destroy(block=block, grace_period=0.0)


def destroy_cached_continuous_batching_manager(self: PreTrainedModel) -> None:
    """Destroy the manager cached by `persistent_manager=True` and drop the engine cached by
    `generate_batch(persistent_manager=True)`, if any, and free the packed copies of its Linears
    (`ContinuousBatchingConfig.packed_linear`)."""
    manager = getattr(self, CACHED_MANAGER_ATTR, None)
    if manager is not None:
        manager.destroy()  # removes itself from the model
    if getattr(self, CACHED_ENGINE_ATTR, None) is not None:
        delattr(self, CACHED_ENGINE_ATTR)
    release_packs(self)
