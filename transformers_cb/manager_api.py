"""The model methods that create, cache and drive `ContinuousBatchingManager`s."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from transformers import GenerationConfig, PreTrainedModel

from .config import ContinuousBatchingConfig
from .generation import take_cb_config
from .manager import ContinuousBatchingManager

CACHED_MANAGER_ATTR = "_transformers_cb_manager"


def init_continuous_batching(
    self: PreTrainedModel,
    generation_config: GenerationConfig | None = None,
    continuous_batching_config: ContinuousBatchingConfig | None = None,
) -> ContinuousBatchingManager:
    """A new (not started) manager for this model; call `start()` on it."""
    cb_config = take_cb_config(generation_config, continuous_batching_config)
    return ContinuousBatchingManager(self, generation_config, cb_config)


@contextmanager
def continuous_batching_context_manager(
    self: PreTrainedModel,
    generation_config: GenerationConfig | None = None,
    block: bool = True,
    timeout: float | None = None,
    continuous_batching_config: ContinuousBatchingConfig | None = None,
    persistent_manager: bool = False,
) -> Iterator[ContinuousBatchingManager]:
    """Start a manager, yield it, then stop it (and destroy it unless `persistent_manager`).

    On exit, `block` / `timeout` bound the wait for queued and running requests whether or not the
    manager is persistent: with `block=False` the exit returns at once (the thread finishes the queue);
    with a `timeout`, what is still running then is hard-stopped (a non-persistent manager) or keeps
    running in the background (a persistent one).

    With `persistent_manager=True` the manager is cached on the model and reused by the next
    context (its configs are those of its first creation). If the block raises, the manager is
    hard-stopped so the exception is not held up by unfinished requests.
    """
    manager = getattr(self, CACHED_MANAGER_ATTR, None) if persistent_manager else None
    if manager is None:
        manager = init_continuous_batching(self, generation_config, continuous_batching_config)
    manager.start()
    failed = False
    try:
        yield manager
    except BaseException:
        failed = True
        raise
    finally:
        manager.stop(block=block, timeout=timeout, hard_stop=failed)
        if persistent_manager:
            setattr(self, CACHED_MANAGER_ATTR, manager)
        else:
            # `stop` already waited as long as asked: a blocking exit hard-stops what is still running
            # (`timeout` passed), a non-blocking one leaves the thread to finish and release the cache.
            manager.destroy(block=block, grace_period=0.0)


def destroy_cached_continuous_batching_manager(self: PreTrainedModel) -> None:
    """Destroy the manager cached by `persistent_manager=True`, if any."""
    manager = getattr(self, CACHED_MANAGER_ATTR, None)
    if manager is not None:
        manager.destroy()
        delattr(self, CACHED_MANAGER_ATTR)
