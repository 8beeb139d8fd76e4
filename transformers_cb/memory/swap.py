"""`SwapCopier`: the page copies between the device tier and the host tier, batched per step.

The scheduler decides swaps as plain page ids (`SwapPlan`, kv/swap_plan.py) and the step's
`StepPlan` carries them; the runner hands them to its copier before the forward (on every
tensor-parallel rank, each on its own KV shard). Each direction is one gather and one scatter per
KV layer group, whatever the number of pages and requests: all layers of a group, K and V, move in
one `index_select` along the page dimension of the group tensor
`[2, layers, pages, page_size, kv heads, head_dim]`.

Ordering inside a step: a page freed by a swap-out may be handed to a swap-in (or to a request that
writes it in this forward) in the same step, and a host page freed by a swap-in may receive a swap-out.
So both gathers run before both scatters, and everything runs before the forward writes the cache.

An int8 cache's scales (memory/kv_quant.py) are a second pair of tier tensors, paged alike: each of its
pages moves with its scales in the same gathers and scatters' order.

On CUDA the copies run on a side stream. The forward waits (an event) only for what it must: the
device-side gather of swapped-out pages (their pages may be reused) and swapped-in pages landing.
The device-to-host transfer overlaps the forward; its host scatter happens at the next plan (or
`synchronize()`), after its event. On a CPU device every copy is synchronous.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch

from ..invariants import check
from ..kv.swap_plan import SwapPlan


@dataclass
class _PendingOut:
    """A CUDA swap-out whose pages are on their way to pinned `staging`; scattered once `done`."""

    done: torch.cuda.Event
    staging: torch.Tensor
    tier: int  # which pair of tier tensors: 0 the pages, 1 an int8 cache's scales
    group: int
    host_ids: torch.Tensor


class SwapCopier:
    """Args: device_tensors / host_tensors: the group tensors of the two tiers (same shapes but pages);
    device_scales / host_scales: an int8 cache's scale tensors of the two tiers (empty: none)."""

    def __init__(
        self,
        device_tensors: list[torch.Tensor],
        host_tensors: list[torch.Tensor],
        device_scales: list[torch.Tensor] | None = None,
        host_scales: list[torch.Tensor] | None = None,
    ) -> None:
        check(len(device_tensors) == len(host_tensors), "one host tensor per device group tensor")
        self.device_tensors = device_tensors
        self.host_tensors = host_tensors
        self.device_scales = device_scales if device_scales is not None else []
        self.host_scales = host_scales if host_scales is not None else []
        check(len(self.device_scales) == len(self.host_scales), "one host scale tensor per device one")
        # The lists themselves (release_cache() refills them in place), pages first, then scales.
        self.tiers = [(self.device_tensors, self.host_tensors)]
        if self.device_scales:
            self.tiers.append((self.device_scales, self.host_scales))
        self.device = device_tensors[0].device
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._pending: list[_PendingOut] = []  # CUDA: swap-outs not scattered into the host pool yet
        self._in_flight: list[tuple[torch.cuda.Event, torch.Tensor]] = []  # swap-in staging kept alive
        self.num_copies = 0  # gather + scatter pairs run (one per group and direction per step)
        self.pages_out = 0  # pages copied to the host tier, since creation
        self.pages_in = 0  # pages copied back

    @torch.inference_mode()
    def run(self, plan: SwapPlan) -> None:
        if plan.is_empty:
            self._collect(wait=False)
            return
        self.pages_out += plan.num_out_pages
        self.pages_in += plan.num_in_pages
        if self.cuda:
            self._run_cuda(plan)
        else:
            self._run_sync(plan)

    def synchronize(self) -> None:
        """Every copy issued so far has landed in its tier (tests, shutdown)."""
        self._collect(wait=True)

    # -- CPU device: plain synchronous copies ------------------------------------------------------
    def _run_sync(self, plan: SwapPlan) -> None:
        out, into = [], []
        for tier, (device, host) in enumerate(self.tiers):  # every gather first: see the module docstring
            for g in range(plan.num_groups):
                if plan.out_src[g]:
                    out.append((tier, g, device[g].index_select(2, _ids(plan.out_src[g], self.device))))
                if plan.in_src[g]:
                    into.append((tier, g, host[g].index_select(2, _ids(plan.in_src[g], "cpu"))))
        for tier, g, pages in into:
            self.tiers[tier][0][g].index_copy_(2, _ids(plan.in_dst[g], self.device), pages.to(self.device))
        for tier, g, pages in out:
            self.tiers[tier][1][g].index_copy_(2, _ids(plan.out_dst[g], "cpu"), pages.to("cpu"))
        self.num_copies += sum(1 for tier, *_ in [*out, *into] if tier == 0)

    # -- CUDA: a side stream ordered with events ---------------------------------------------------
    def _run_cuda(self, plan: SwapPlan) -> None:
        # Swap-ins read the host pool: earlier swap-outs must have landed there first.
        self._collect(wait=any(plan.in_src))
        main = torch.cuda.current_stream(self.device)
        side = cast(torch.cuda.Stream, self.stream)  # created on CUDA, where this runs
        # Pages to gather were written by earlier forwards; fresh pages may still be read by them.
        side.wait_stream(main)
        gathered = []
        with torch.cuda.stream(side):
            for tier, (device, _) in enumerate(self.tiers):
                for g in range(plan.num_groups):
                    if plan.out_src[g]:
                        ids = _ids(plan.out_src[g], "cpu").to(self.device, non_blocking=True)
                        gathered.append((tier, g, device[g].index_select(2, ids)))
            for device, hosts in self.tiers:
                for g in range(plan.num_groups):
                    if not plan.in_src[g]:
                        continue
                    host = hosts[g]
                    shape = (host.shape[0], host.shape[1], len(plan.in_src[g]), *host.shape[3:])
                    staging = torch.empty(shape, dtype=host.dtype, pin_memory=True)
                    torch.index_select(host, 2, _ids(plan.in_src[g], "cpu"), out=staging)
                    pages = staging.to(self.device, non_blocking=True)
                    ids = _ids(plan.in_dst[g], "cpu").to(self.device, non_blocking=True)
                    device[g].index_copy_(2, ids, pages)
                    landed = torch.cuda.Event()
                    landed.record(side)
                    self._in_flight.append((landed, staging))
            ready = torch.cuda.Event()
            ready.record(side)
            for tier, g, pages in gathered:
                staging = torch.empty(pages.shape, dtype=pages.dtype, pin_memory=True)
                staging.copy_(pages, non_blocking=True)
                done = torch.cuda.Event()
                done.record(side)
                self._pending.append(_PendingOut(done, staging, tier, g, _ids(plan.out_dst[g], "cpu")))
        main.wait_event(
            ready
        )  # the forward waits for the gathers and the swap-ins, not for the transfers out
        self.num_copies += sum(1 for tier, *_ in gathered if tier == 0) + sum(1 for ids in plan.in_src if ids)

    def _collect(self, wait: bool) -> None:
        """Scatter finished swap-outs into the host pool (all of them, waiting, when `wait`), in order."""
        while self._pending and (wait or self._pending[0].done.query()):
            pending = self._pending.pop(0)
            pending.done.synchronize()
            self.tiers[pending.tier][1][pending.group].index_copy_(2, pending.host_ids, pending.staging)
        self._in_flight = [(event, staging) for event, staging in self._in_flight if not event.query()]


def _ids(page_ids: list[int], device: torch.device | str) -> torch.Tensor:
    return torch.tensor(page_ids, dtype=torch.int64, device=device)
