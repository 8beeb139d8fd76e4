"""The cache given back while a trainer trains (`ContinuousBatchingManager.release_cache`, docs/manager.md).

`release_cache(engine)` drops every request's KV (they recompute after the resume: `Scheduler.drop_all_kv`)
and the prefix cache, then frees the device cache's tensors, the host tier's and the packed copies of the
weights; `restore_cache(engine)` allocates the tensors again (the packs are rebuilt at their next product).
The page pools' bookkeeping (ids, a few bytes per page) stays: every page is free in between. Called between
two steps, outside the engine's run session (the model is then the user's: a trainer may run it).
"""

from __future__ import annotations

import ctypes
import ctypes.util
from dataclasses import dataclass, field

import torch

from ..memory.released_tensors import TensorSpec, release_in_place, restore_in_place
from ..runner.products.packed_model import model_pack_bytes, release_packs
from .engine import Engine
from .publisher import TensorParallelPublisher


@dataclass
class ReleasedCache:
    """What a release gave back: the host tier's tensors (None: no host tier) and the bytes freed;
    `host_scales`: an int8 cache's host scale tensors (memory/kv_quant.py; empty: none)."""

    host: list[TensorSpec] | None
    freed_bytes: int
    host_scales: list[TensorSpec] = field(default_factory=list)


def release_problem(engine: Engine) -> str | None:
    """Why `engine`'s cache cannot be released (None: it can). Each of these holds tensors or addresses
    this module does not rebuild."""
    if engine.is_follower or isinstance(engine.publisher, TensorParallelPublisher):
        return "tensor parallelism"
    if engine.settings.states is not None:
        return "a model with state layers (its state slots)"
    if engine.runner.graphs is not None:
        return "CUDA graphs (they hold the cache's addresses)"
    if engine.drafter is not None:
        return "a draft model (its own KV cache)"
    return None


def release_cache(engine: Engine) -> ReleasedCache:
    """Drop all KV and free the cache's tensors (module docstring); `engine` must have none released."""
    problem = release_problem(engine)
    if problem is not None:
        raise ValueError(f"release_cache() does not support {problem} yet")
    engine.scheduler.drop_all_kv()
    engine.pages.clear_prefix_cache()
    if engine.cache.group_tensors and engine.cache.group_tensors[0].device.type == "cuda":
        torch.cuda.synchronize()  # no swap copy may still read or write the tensors freed below
    freed = model_pack_bytes(engine.model)
    release_packs(engine.model)
    freed += engine.cache.release()
    host, host_scales = None, []
    swapper = engine.runner.swapper
    if swapper is not None:
        freed += sum(t.numel() * t.element_size() for t in [*swapper.host_tensors, *swapper.host_scales])
        host = release_in_place(swapper.host_tensors)
        host_scales = release_in_place(swapper.host_scales)
    if torch.cuda.is_available() and engine.cache.layout.device.type == "cuda":
        torch.cuda.empty_cache()  # the caching allocator gives the freed blocks back to the device
    trim_heap()
    return ReleasedCache(host, freed, host_scales)


def trim_heap() -> None:
    """Hand the C heap's free memory back to the OS (glibc's `malloc_trim`; elsewhere nothing). The packs are
    a few MB each: once glibc has freed large blocks it serves such sizes from its heap, which it keeps."""
    name = ctypes.util.find_library("c")
    if name is None:
        return
    libc = ctypes.CDLL(name)
    if hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def restore_cache(engine: Engine, released: ReleasedCache) -> None:
    """Allocate again what `release_cache` freed (the same shapes, so the same settings hold)."""
    engine.cache.restore()
    swapper = engine.runner.swapper
    if swapper is not None and released.host is not None:
        restore_in_place(swapper.host_tensors, released.host, zero=False)
        restore_in_place(swapper.host_scales, released.host_scales, zero=False)
