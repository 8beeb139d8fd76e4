"""A scheduler + real KV tensors + the host tier, driven by a fake model that writes a known value for every
(request, position) and checks, before each step, that every page a request reads still holds its values."""

from __future__ import annotations

import zlib

import torch

from tests.support.scheduling import scheduler_settings
from transformers_cb.kv.layer_groups import FULL_ATTENTION, SLIDING_ATTENTION, KVGroupSpec
from transformers_cb.kv.offload import CpuOffload
from transformers_cb.kv.page_manager import PageManager
from transformers_cb.kv.page_policies import make_page_policy
from transformers_cb.kv.pool import PagePool
from transformers_cb.memory.host_cache import HostKVCache
from transformers_cb.memory.kv_cache import PagedKVCache
from transformers_cb.memory.swap import SwapCopier
from transformers_cb.requests import Request
from transformers_cb.sampling.sampled_token import SampledToken
from transformers_cb.scheduler.scheduler import Scheduler
from transformers_cb.scheduler.step_plan import StepPlan


class Rig:
    """Args: num_pages / host_pages: pages of each group in the device / host tier (host 0: no offload);
    sliding_window: adds a second, sliding group (layer 1) next to the full one (layer 0)."""

    def __init__(
        self, num_pages: int, host_pages: int, page_size: int = 4, sliding_window: int | None = None
    ) -> None:
        self.groups = [KVGroupSpec(FULL_ATTENTION, (0,))]
        if sliding_window is not None:
            self.groups.append(KVGroupSpec(SLIDING_ATTENTION, (1,), sliding_window))
        self.page_size = page_size
        self.cache = PagedKVCache(
            len(self.groups), num_pages, page_size, 1, 2, torch.float32, torch.device("cpu"), self.groups
        )
        self.pools = [
            PagePool(num_pages) for _ in self.groups
        ]  # the device pages' ids: kv/'s, beside the policies
        self.policies = [
            make_page_policy(spec, pool, page_size, g)
            for g, (spec, pool) in enumerate(zip(self.groups, self.pools, strict=True))
        ]
        self.offload = self.copier = None
        if host_pages:
            self.host = HostKVCache(self.cache, host_pages)  # the bytes; the page ids: `offload.host`
            self.copier = SwapCopier(self.cache.group_tensors, self.host.tensors)
            self.offload = CpuOffload(self.policies, host_pages)
        self.scheduler = Scheduler(
            PageManager(self.policies, self.groups), scheduler_settings(), 64, 64, self.offload
        )
        self.steps = 0

    def value(self, request: Request, position: int) -> float:
        return float(zlib.crc32(request.request_id.encode()) % 1000 * 1000 + position)

    def slot(self, request: Request, group: int, position: int) -> int:
        pages = request.group_pages(group)
        return pages.page_ids[position // self.page_size - pages.first_page] * self.page_size + (
            position % self.page_size
        )

    def readable(self, request: Request, group: int, end: int) -> range:
        start = self.policies[group].first_needed_page(end) * self.page_size
        return range(start, end)

    def check_kv(self, request: Request, end: int) -> None:
        """Every position [.., end) the request's next query reads holds its value, in every layer, K and V."""
        for g, spec in enumerate(self.groups):
            layer = spec.layer_indices[0]
            for position in self.readable(request, g, end):
                slot = self.slot(request, g, position)
                expected = self.value(request, position)
                assert self.cache.keys[layer][slot, 0, 0].item() == expected, (
                    request.request_id,
                    g,
                    position,
                )
                assert self.cache.values[layer][slot, 0, 1].item() == -expected, (
                    request.request_id,
                    g,
                    position,
                )

    def run_swaps(self) -> None:
        """Run the swaps planned outside `schedule()` (tests calling the offload hooks directly)."""
        self.copier.run(self.offload.take_plan())

    def step(self) -> StepPlan:
        batch = self.scheduler.schedule()
        self.execute(batch)
        return batch

    def execute(self, batch: StepPlan) -> None:
        """Run a scheduled step: the planned swaps, then write and check the KV, then sample."""
        if batch.swaps is not None:
            self.copier.run(batch.swaps)
        sampled = []
        for entry in batch.entries:
            request = entry.request
            self.check_kv(request, entry.start)
            for position in range(entry.start, entry.end):
                for g, spec in enumerate(self.groups):
                    slot = self.slot(request, g, position)
                    layer = spec.layer_indices[0]
                    self.cache.keys[layer][slot] = self.value(request, position)
                    self.cache.values[layer][slot] = -self.value(request, position)
            if entry.samples:
                sampled.append([SampledToken(10 + sum(request.all_token_ids) % 200)])
        self.scheduler.update(batch, sampled)
        self.steps += 1
        self.check_integrity()

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()  # device pools (with kept shared pages), host pools, queues

    def run(self, max_steps: int = 500) -> None:
        while self.scheduler.has_work():
            self.step()
            assert self.steps < max_steps, "no progress"
