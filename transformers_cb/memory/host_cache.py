"""`HostKVCache`: the bytes of the host tier of the KV cache (CPU offload), and how big it is.

A second set of pages in host memory that receives a preempted request's pages and gives them back
(see kv/offload.py for who goes there and which host page ids are free, `swap.py` for the copies).
It mirrors the device cache group by group: each KV layer group has one tensor shaped like the
device group's tensor `[2, layers, pages, page_size, kv heads, head_dim]`, so a page moves between
the tiers as one slice along the page dimension. The host page ids (a `PagePool` per group) live
with the planner, torch-free (`kv.offload.HostPages`); under tensor parallelism every rank holds a
tier of the same number of pages (the smallest any rank can afford) and replays rank 0's swaps.
Allocated once; pinned when the device is CUDA (so that copies are asynchronous DMA), plain memory
on a CPU device, where the tier is simply a bounded second pool whose point is to skip recomputation.

Host page ids are their own id space: host page 3 has nothing to do with device page 3.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import psutil
import torch

from ..config.continuous_batching import ContinuousBatchingConfig
from ..invariants import check
from ..kv.page_policies import num_pages_for
from .kv_cache import CacheLayout, PagedKVCache

logger = logging.getLogger(__name__)

GIB = 2**30
CPU_HOST_CACHE_FACTOR = 4


@dataclass(frozen=True)
class HostSettings:
    """The host tier of one engine (part of the `EngineSettings`): `num_pages` host pages in every KV group
    (0: no CPU offload), from `resolve_host_pages`, the same on every tensor-parallel rank (the fewest any
    rank can afford) so that rank 0's host page ids are valid everywhere."""

    num_pages: int


def host_page_bytes(device_cache: PagedKVCache) -> int:
    """Bytes of one page in every group (a host page id exists in each group's pool)."""
    return device_cache.layout.page_bytes()


def offload_budget_bytes(config: ContinuousBatchingConfig, reserved_bytes: int = 0) -> int:
    """`cpu_offload_space` in bytes, capped at `cpu_offload_space_safety_threshold` x available RAM
    (None: exactly that share). `reserved_bytes`: RAM about to be taken that `available` does not show
    yet (a CPU device cache resolved but not allocated)."""
    available = max(0, psutil.virtual_memory().available - reserved_bytes)
    cap = int(config.cpu_offload_space_safety_threshold * available)
    if config.cpu_offload_space is None:
        return cap
    requested = int(config.cpu_offload_space * GIB)
    if requested > cap:
        logger.warning(
            "cpu_offload_space=%g GiB is more than cpu_offload_space_safety_threshold=%g of the available RAM; "
            "the host tier gets %.2f GiB",
            config.cpu_offload_space,
            config.cpu_offload_space_safety_threshold,
            cap / GIB,
        )
        return cap
    return requested


def resolve_host_pages(
    config: ContinuousBatchingConfig, device_cache: CacheLayout, workload: list[int] | None = None
) -> int:
    """Host pages per KV group: the budget over the bytes of one page in every group.

    Resolved from the device cache's layout, before the device cache is allocated: on a CPU device,
    whose cache takes the same RAM, its bytes are counted as taken (as if allocated already).
    With the workload known (generate_batch), never more than every request at full length needs at
    once: more could never be used, so the tier fits the job rather than all RAM. On a CPU device with
    the workload unknown (a server), where both tiers share the same RAM, at most
    `CPU_HOST_CACHE_FACTOR` times the device cache (as the device cache itself is capped there).
    0 when offload is off (`cpu_offload_space == 0.0`) or the budget is smaller than one page.
    """
    if config.cpu_offload_space == 0.0:
        return 0
    on_cpu = device_cache.device.type == "cpu"
    reserved = device_cache.nbytes() if on_cpu else 0
    page_bytes = device_cache.page_bytes()
    num_pages = offload_budget_bytes(config, reserved) // page_bytes
    if workload:
        num_pages = min(num_pages, sum(num_pages_for(n, device_cache.page_size) for n in workload))
    elif on_cpu:
        num_pages = min(num_pages, CPU_HOST_CACHE_FACTOR * max(device_cache.pages))
    if num_pages < 1:
        logger.warning(
            "cpu_offload_space is smaller than one KV page (%d bytes in every layer group): CPU offload is off, "
            "evicted requests are recomputed",
            page_bytes,
        )
    return max(0, int(num_pages))


class HostKVCache:
    """Args: device_cache: the device tier it mirrors; num_pages: host pages of every group (>= 1)."""

    def __init__(self, device_cache: PagedKVCache, num_pages: int) -> None:
        check(num_pages >= 1, f"{num_pages=}")
        self.num_pages = num_pages
        self.page_size = device_cache.page_size
        device = device_cache.group_tensors[0].device
        self.pinned = device.type == "cuda"
        # `empty`, not `zeros`: a host page is only ever read after a swap-out wrote it, and an untouched
        # allocation costs no RAM on a CPU host until used.
        self.tensors = [_host_pages(t, num_pages, self.pinned) for t in device_cache.group_tensors]
        # An int8 device cache's scales (memory/kv_quant.py), paged alike: a page swaps with its scales.
        self.scales = [_host_pages(t, num_pages, self.pinned) for t in device_cache.scale_tensors]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [*self.tensors, *self.scales])


def _host_pages(device_tensor: torch.Tensor, num_pages: int, pinned: bool) -> torch.Tensor:
    """A host tensor shaped like `device_tensor` `[streams, layers, pages, ...]` with `num_pages` pages."""
    shape = (device_tensor.shape[0], device_tensor.shape[1], num_pages, *device_tensor.shape[3:])
    return torch.empty(shape, dtype=device_tensor.dtype, device="cpu", pin_memory=pinned)
