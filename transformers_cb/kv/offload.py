"""`CpuOffload`: which pages of a preempted request go to the host tier, and how they come back.

The scheduler's hooks (plain page ids, no tensors):
- `try_swap_out(request)` in preemption: copies (planned) the request's pages of every KV group to
  host pages, so that the scheduler's usual release frees the device pages and the request keeps its
  `num_computed_tokens`. False (nothing changed) when the host tier lacks room: the caller falls back
  to recompute. A request needing more host pages than the whole tier is never swapped.
- `can_swap_in(request)` / `swap_in(request)` at admission of a swapped-out request: fresh device
  pages receive the host pages (planned), the host pages are freed, and the request continues exactly
  where it stopped.
- `discard(request)` when a swapped-out request ends (cancelled, failed, hard stop) or falls back to
  recompute: its host pages (and the device pages it kept) are freed.

A model with state layers swaps its request's state slot with its pages, as one more group of the plan
(the slot group after the KV groups, as in `PageManager`: state_slots.py): the request swaps out only
when both the pages and a host slot have room (and it holds a slot), swaps in only when a device slot is
free too, and its host slot goes with its host pages.

Shared pages (refcount > 1 on the device: another request still references them) are not copied: the
swapped-out request keeps its own reference (taken here, so the scheduler's release leaves the page
resident) and gets the same page back on swap-in. Only exclusively owned pages move. Sliding-window
groups swap only the pages the request still holds (from `first_page` on).

The copies of one step are collected in a `SwapPlan` (plain ids, swap_plan.py) that `schedule()`
moves into the step's `StepPlan` (`take_plan`); the runner's `SwapCopier` (memory/swap.py)
runs it before the step's forward, one gather/scatter per group and direction, on every
tensor-parallel rank. This module stays torch-free: the host tier's bytes are
`memory.host_cache.HostKVCache` (and the states' host copy, memory/state_cache.py), its page ids
(`HostPages`, one `PagePool` per group, and its state slots) are here.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..invariants import InvariantError, check
from ..requests import PageList, Request
from .page_policies import PagePolicy, num_pages_for
from .pool import PagePool
from .state_slots import StateSlotPolicy
from .swap_plan import SwapPlan


@dataclass
class SwappedGroup:
    """A swapped-out request's pages in one KV group: logical page `first_page + i` is host page
    `page_ids[i]` when `on_host[i]`, else device page `page_ids[i]` (a shared page it kept)."""

    first_page: int
    page_ids: list[int]
    on_host: list[bool]

    @property
    def host_ids(self) -> list[int]:
        return [p for p, host in zip(self.page_ids, self.on_host, strict=True) if host]

    @property
    def kept_device_ids(self) -> list[int]:
        return [p for p, host in zip(self.page_ids, self.on_host, strict=True) if not host]


class HostPages:
    """The host tier's page ids: `num_pages` in each KV group's own pool (host page 3 has nothing to do
    with device page 3), and `num_slots` state slots (a model with state layers; 0: none), held by the
    swapped-out requests."""

    def __init__(self, num_pages: int, num_groups: int, num_slots: int = 0) -> None:
        check(num_pages >= 1, f"{num_pages=}")
        self.num_pages = num_pages
        self.pools = [PagePool(num_pages) for _ in range(num_groups)]
        self.slots = StateSlotPolicy(num_slots) if num_slots else None

    @property
    def num_used_pages(self) -> int:
        return sum(pool.num_used_pages for pool in self.pools)

    def check_integrity(self, page_tables: list[list[list[int]]]) -> None:
        """`page_tables[g]`: the host page lists of every swapped-out request in group `g`."""
        if len(page_tables) != len(self.pools):
            raise InvariantError(f"{len(page_tables)} groups of host tables for {len(self.pools)} host pools")
        for pool, tables in zip(self.pools, page_tables, strict=True):
            pool.check_integrity(tables)


class CpuOffload:
    """Args: policies: the device tier's page policies, one per KV group (as in `PageManager`);
    num_host_pages: host pages of every group (>= 1; the same on every tensor-parallel rank); slots: the
    device's state slots (`PageManager.slots`; None: no state layers), with as many host slots."""

    def __init__(
        self, policies: list[PagePolicy], num_host_pages: int, slots: StateSlotPolicy | None = None
    ) -> None:
        self.policies = policies
        self.slots = slots
        self.host = HostPages(num_host_pages, len(policies), slots.num_slots if slots is not None else 0)
        self.page_size = policies[0].page_size
        self.slot_group = len(policies)  # as `PageManager.slot_group`
        self.swapped: dict[str, list[SwappedGroup]] = {}  # request id -> its pages, per group
        self.plan = self._empty_plan()  # planned since the last `take_plan`
        self.swap_out_pages = 0  # pages copied to the host tier, since creation
        self.swap_in_pages = 0  # pages copied back
        self.kept_pages = 0  # shared pages a swap-out left resident (not copied), since creation
        self.num_swap_outs = 0
        self.num_fallbacks = 0  # preemptions that found no room in the host tier (recomputed instead)

    @property
    def num_swapped_out(self) -> int:
        return len(self.swapped)

    def is_swapped(self, request: Request) -> bool:
        return request.request_id in self.swapped

    def _empty_plan(self) -> SwapPlan:
        return SwapPlan(len(self.policies) + (self.slots is not None))

    # -- swap out ----------------------------------------------------------------------------------
    def try_swap_out(self, request: Request) -> bool:
        """Plan the copy of `request`'s exclusive pages to the host tier. False (nothing changed) if there
        is nothing to keep or the host tier lacks room; the caller then frees and recomputes."""
        slots, host_slots = self.slots, self.host.slots
        if slots is not None and not (
            host_slots is not None and host_slots.has_free() and slots.holds(request)
        ):
            return False  # a state goes with its pages or not at all
        if request.num_computed_tokens == 0 or not request.holds_pages:
            return False
        held = [a.pages(request) for a in self.policies]
        exclusive = [
            [p for p in pages.page_ids if a.pool.refcount(p) == 1]
            for a, pages in zip(self.policies, held, strict=True)
        ]
        if any(len(ids) > pool.num_free_pages for ids, pool in zip(exclusive, self.host.pools, strict=True)):
            self.num_fallbacks += 1
            return False
        groups = []
        for g, (policy, pages, ids) in enumerate(zip(self.policies, held, exclusive, strict=True)):
            host_ids = self.host.pools[g].allocate(len(ids))
            if host_ids is None:
                raise InvariantError("host pages counted as free but not allocated")
            free_host = iter(host_ids)
            page_ids, on_host = [], []
            for page_id in pages.page_ids:
                if policy.pool.refcount(page_id) == 1:
                    page_ids.append(next(free_host))
                    on_host.append(True)
                else:  # shared: stays resident; this reference survives the scheduler's release
                    policy.pool.share([page_id])
                    page_ids.append(page_id)
                    on_host.append(False)
                    self.kept_pages += 1
            self.plan.out_src[g].extend(ids)
            self.plan.out_dst[g].extend(host_ids)
            groups.append(SwappedGroup(pages.first_page, page_ids, on_host))
            self.swap_out_pages += len(ids)
        if slots is not None and host_slots is not None:
            self.plan.out_src[self.slot_group].append(slots.slot_of(request))
            self.plan.out_dst[self.slot_group].append(host_slots.acquire(request))
        self.swapped[request.request_id] = groups
        self.num_swap_outs += 1
        return True

    # -- swap in -----------------------------------------------------------------------------------
    def pages_to_swap_in(self, request: Request) -> list[int]:
        """Device pages each group needs to take `request` back and run its next token. Pure."""
        needed = []
        next_end = num_pages_for(request.num_computed_tokens + 1, self.page_size)
        for group in self.swapped[request.request_id]:
            end_page = group.first_page + len(group.page_ids)
            needed.append(sum(group.on_host) + max(0, next_end - end_page))
        return needed

    def can_swap_in(self, request: Request) -> bool:
        if self.slots is not None and not self.slots.has_free():
            return False
        needed = self.pages_to_swap_in(request)
        return all(n <= a.pool.num_free_pages for n, a in zip(needed, self.policies, strict=True))

    def swap_in(self, request: Request) -> None:
        """Give `request` fresh device pages for its host pages (copies planned), its kept shared pages
        back and (state layers) a device slot for its host slot. Only after `can_swap_in` said yes."""
        check(self.can_swap_in(request), f"{request.request_id}: swap_in without room")
        groups = self.swapped.pop(request.request_id)
        for g, (policy, group) in enumerate(zip(self.policies, groups, strict=True)):
            host_ids = group.host_ids
            device_ids = policy.pool.allocate(len(host_ids))
            if device_ids is None:
                raise InvariantError("device pages counted as free but not allocated")
            fresh = iter(device_ids)
            page_ids = [
                next(fresh) if host else p for p, host in zip(group.page_ids, group.on_host, strict=True)
            ]
            pages = policy.pages(request)
            check(not pages.page_ids, f"{request.request_id}: swapped in while holding pages")
            request.pages[g] = PageList(page_ids, group.first_page)
            self.plan.in_src[g].extend(host_ids)
            self.plan.in_dst[g].extend(device_ids)
            # Freed now: the copy that reads them runs before any later swap-out writes them (swap.py).
            self.host.pools[g].release(host_ids)
            self.swap_in_pages += len(host_ids)
        if self.slots is not None and self.host.slots is not None:
            self.plan.in_src[self.slot_group].append(self.host.slots.slot_of(request))
            self.plan.in_dst[self.slot_group].append(self.slots.acquire(request))
            self.host.slots.release(request)

    # -- end or fallback ---------------------------------------------------------------------------
    def discard(self, request: Request) -> None:
        """Forget `request`'s swapped pages (it ended, or recomputes instead): host pages (and host slot)
        and the device pages it kept are released. A no-op for a request that is not swapped out."""
        groups = self.swapped.pop(request.request_id, None)
        if groups is None:
            return
        for g, (policy, group) in enumerate(zip(self.policies, groups, strict=True)):
            host_ids = group.host_ids
            self.host.pools[g].release(host_ids)
            policy.pool.release(group.kept_device_ids)
            self._drop_planned_out(g, set(host_ids))
        host_slots = self.host.slots
        if host_slots is not None and host_slots.holds(request):
            self._drop_planned_out(self.slot_group, {host_slots.slot_of(request)})
            host_slots.release(request)

    def _drop_planned_out(self, g: int, dropped: set[int]) -> None:
        """Not copied yet: drop the swap-outs into `dropped` host ids of group `g`, which may be reused at once."""
        if not self.plan.out_dst[g]:
            return
        pairs = [
            (s, d)
            for s, d in zip(self.plan.out_src[g], self.plan.out_dst[g], strict=True)
            if d not in dropped
        ]
        self.plan.out_src[g] = [s for s, _ in pairs]
        self.plan.out_dst[g] = [d for _, d in pairs]

    def take_plan(self) -> SwapPlan:
        """The swaps planned since the last call (the step's), for its `StepPlan`."""
        plan, self.plan = self.plan, self._empty_plan()
        return plan

    def device_tables(self) -> list[list[list[int]]]:
        """Per group, the device pages each swapped-out request still references (for pool integrity)."""
        return [
            [groups[g].kept_device_ids for groups in self.swapped.values()] for g in range(len(self.policies))
        ]

    def check_integrity(self, waiting_ids: set[str]) -> None:
        """Host pools (and host slots) match the swapped-out requests, which all wait; raises
        `InvariantError`."""
        unknown = set(self.swapped) - waiting_ids
        if unknown:
            raise InvariantError(f"swapped-out requests not waiting: {sorted(unknown)}")
        self.host.check_integrity(
            [[groups[g].host_ids for groups in self.swapped.values()] for g in range(len(self.policies))]
        )
        for groups in self.swapped.values():
            for group in groups:
                check(len(group.page_ids) == len(group.on_host), "a swapped group's lists disagree")
        if self.host.slots is not None:
            self.host.slots.check_integrity(set(self.swapped))


class NoOffload:
    """The host tier's planner where there is none (no CPU offload): nothing is ever swapped, a preempted
    request always recomputes, a step plans no swaps (`take_plan` is None: `StepPlan.swaps`). The scheduler
    and its admission hold one in place of None, so that no call site asks whether offload is on."""

    def is_swapped(self, request: Request) -> bool:
        return False

    def try_swap_out(self, request: Request) -> bool:
        return False  # no room: the caller frees the pages and recomputes

    def can_swap_in(self, request: Request) -> bool:
        return False

    def swap_in(self, request: Request) -> None:
        raise InvariantError(f"{request.request_id}: swapped in without a host tier")

    def discard(self, request: Request) -> None:
        return None  # nothing on a host tier to free

    def take_plan(self) -> None:
        return None

    def device_tables(self) -> None:
        return None  # no swapped-out request keeps device pages

    def check_integrity(self, waiting_ids: set[str]) -> None:
        return None


Offload = CpuOffload | NoOffload  # the scheduler's host-tier planner, a real one or the null one


def offload_or_none(offload: CpuOffload | None) -> Offload:
    """`offload`, or the null planner where there is no host tier."""
    return offload if offload is not None else NoOffload()
