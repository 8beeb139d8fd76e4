"""What the engine has done and holds, as plain numbers: `EngineCounters` (work since creation or the
last reset) and `EngineSnapshot` (every count `manager.stats()` reports, at one moment), read from an
engine's parts by `snapshot_of` (`Engine.snapshot()`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from ..kv.prefix_cache import PrefixStats
from ..runner.products.packed_model import model_pack_bytes
from ..scheduler.speculation.speculation_stats import SpeculationStats

if TYPE_CHECKING:
    from .parts import EngineParts
    from .settings import EngineSettings


@dataclass
class EngineCounters:
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    generated_tokens: int = 0
    failed_steps: int = 0


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's counts at one moment (`Engine.snapshot()`; the defaults are those of no engine)."""

    running: int = 0
    waiting: int = 0
    preemptions: int = 0
    pages_in_use: int = 0
    pages_total: int = 0
    pages_in_use_by_group: dict[str, int] = field(default_factory=dict)
    prefix: PrefixStats = field(default_factory=PrefixStats)  # all zero when sharing is off
    prefix_cache_pages: int = 0  # pages kept only for later hits, all groups
    prefix_cache_evictions: int = 0
    recomputed_tokens: int = 0
    swapped_out: int = 0  # requests in the host tier now (CPU offload)
    swap_out_pages: int = 0
    swap_in_pages: int = 0
    compiled_graphs: int = 0  # torch.compile graphs built by this engine's steps (warm-up included)
    state_slots_in_use: int = 0  # state layers (docs/state_layers.md): slots held by running requests
    state_slots_total: int = 0
    state_bytes_per_slot: int = 0
    kv_bytes_per_token: int = 0  # one token's KV in every group (a latent group: its latent vector)
    weight_version: int = 0  # the model's weight version (`Engine.weight_version`)
    packed_weight_bytes: int = 0  # packed copies of the model's Linear weights held now (docs/design.md)
    media_items_encoded: int = 0  # images / videos / audio clips encoded (docs/multimodal.md)
    media_encode_seconds: float = 0.0  # time the encoder took, off the decoder's forwards
    media_store_rows: int = 0  # embedding rows held now, of `media_store_capacity`
    media_store_capacity: int = 0
    counters: EngineCounters = field(default_factory=EngineCounters)
    speculation: SpeculationStats = field(
        default_factory=SpeculationStats
    )  # verification steps, all requests


def snapshot_of(settings: EngineSettings, parts: EngineParts, counters: EngineCounters) -> EngineSnapshot:
    """An engine's counts now, from its settings, parts and counters (copies, not views)."""
    scheduler, pages, offload, runner = parts.scheduler, parts.pages, parts.offload, parts.runner
    slots = pages.slots
    media, budget = runner.media, scheduler.media
    return EngineSnapshot(
        running=len(scheduler.running),
        waiting=len(scheduler.waiting),
        preemptions=scheduler.num_preemptions,
        pages_in_use=sum(pool.num_used_pages for pool in pages.pools),
        pages_total=sum(pool.num_pages for pool in pages.pools),
        pages_in_use_by_group=pages.pages_in_use(),
        prefix=replace(pages.prefix_stats),
        prefix_cache_pages=pages.num_cached_pages,
        prefix_cache_evictions=pages.num_evictions,
        recomputed_tokens=scheduler.recomputed.total,
        swapped_out=offload.num_swapped_out if offload is not None else 0,
        swap_out_pages=offload.swap_out_pages if offload is not None else 0,
        swap_in_pages=offload.swap_in_pages if offload is not None else 0,
        compiled_graphs=runner.forwards.graphs_compiled,
        state_slots_in_use=slots.num_in_use if slots is not None else 0,
        state_slots_total=slots.num_slots if slots is not None else 0,
        state_bytes_per_slot=settings.states.bytes_per_slot if settings.states is not None else 0,
        kv_bytes_per_token=settings.cache.layout.bytes_per_token(),
        weight_version=scheduler.weight_version,
        packed_weight_bytes=model_pack_bytes(parts.model) if settings.step_options.packed_linear else 0,
        media_items_encoded=media.items_encoded,
        media_encode_seconds=media.encode_seconds,
        media_store_rows=budget.used if budget is not None else 0,
        media_store_capacity=budget.capacity if budget is not None else 0,
        speculation=replace(scheduler.speculation),
        counters=replace(counters),
    )
