"""`PageManager`: the device tier's pages as one facade for the scheduler.

It holds the page policies of every KV layer group and, when prefix sharing is on, the
`PrefixCache` over them. A request runs `n` more tokens only if every group can take them, so fit
checks take the minimum over groups and allocation is check-then-commit across all groups (nothing
changes unless every group has the pages). Release, preemption and the step-boundary trim of sliding
windows go to every group at once. Prefix sharing is reached through it too (`attach_prefix`,
`promise`, `waits_for_pages`, `register`, `fork`, ...; each a no-op or "nothing" when sharing is
off), so that the scheduler never needs to know whether it is on beyond `sharing`.

A model with state layers adds its per-request state slots as one more group behind the facade (the
slot group, `slot_group`, after the KV groups; state_slots.py): a running request holds exactly one
slot, so fit and allocation need a free one for a request that holds none, `free` releases it, a fork
copies it (a copy entry of the slot group) and the integrity check holds the slots to the running
requests. A pure state-space model (e.g. Mamba) has no KV group at all: only the slot group.

The host tier (CPU offload, offload.py) is not behind this facade: the scheduler gets it explicitly.
It is a second tier with its own pools and its own decision (swap out or recompute, which victim
comes back when), while everything here is about one tier's pages; keeping it out keeps this
facade's contract (one check-then-commit over the device groups) whole, and lets a scheduler run
without offload by passing nothing rather than by a facade that half-exists.
"""

from __future__ import annotations

from ..invariants import InvariantError, check
from ..requests import Request
from .layer_groups import KVGroupSpec
from .page_keys import PageCopy
from .page_policies import PagePolicy
from .pool import PagePool
from .prefix_cache import PrefixCache, PrefixStats
from .rope_rule import RopeRule
from .state_slots import StateSlotPolicy


class PageManager:
    """Args: policies: one per KV group, `policies[g].group == g`; specs: the matching groups;
    sharing: prefix sharing and forks (`prefix`, see prefix_cache.py), None when off; page_size: the
    tokens per page when there are no groups (a pure state-space model, e.g. Mamba: no layer caches
    K/V, so its requests hold no pages and every fit check says yes, but for its slots); slots: the
    per-request state slots of a model with state layers (None: none), the slot group.
    """

    def __init__(
        self,
        policies: list[PagePolicy],
        specs: list[KVGroupSpec],
        sharing: bool = False,
        page_size: int | None = None,
        slots: StateSlotPolicy | None = None,
        rope: RopeRule | None = None,
    ) -> None:
        check(len(policies) == len(specs), f"{len(policies)} policies, {len(specs)} groups")
        check(bool(policies) or page_size is not None, "a page manager without groups needs its page size")
        check(not (sharing and not policies), "prefix sharing without KV groups")
        check([a.group for a in policies] == list(range(len(policies))))
        self.policies = policies
        self.specs = specs
        self.page_size = policies[0].page_size if policies else int(page_size or 0)
        # Only sliding and chunked groups ever drop pages at a step boundary; full-attention-only models
        # skip the trim.
        self._trimming = [a for a in policies if a.trims]
        self.prefix = PrefixCache(policies, rope) if sharing else None
        # A dynamic rotary embedding's rule (kv/rope_rule.py): the scheduler drops a request's KV where
        # the model's `generate()` recomputes it (`RopeRule.must_recompute`).
        self.rope = rope
        self.slots = slots
        # The slot group's index in copies and swaps: right after the KV groups.
        self.slot_group = len(policies)

    @property
    def sharing(self) -> bool:
        """Prefix sharing (and forks) on."""
        return self.prefix is not None

    @property
    def prefix_stats(self) -> PrefixStats:
        """Prefix-cache lookups since creation (all zero when sharing is off)."""
        return self.prefix.stats if self.prefix is not None else PrefixStats()

    @property
    def pools(self) -> list[PagePool]:
        return [a.pool for a in self.policies]

    @property
    def free_fraction(self) -> float:
        """Free share of the fullest group: admission looks at the group that runs out first."""
        return min((pool.num_free_pages / pool.num_pages for pool in self.pools), default=1.0)

    def state_slot(self, request: Request) -> int:
        """The request's state slot (the runner's row of its states); -1 without state layers."""
        return -1 if self.slots is None else self.slots.slot_of(request)

    def _lacks_slot(self, request: Request) -> bool:
        """The request needs a slot and none is free."""
        slots = self.slots
        return slots is not None and not slots.has_free() and not slots.holds(request)

    def num_fitting_tokens(self, request: Request, wanted: int) -> int:
        """How many of `wanted` new tokens every group can take (none without a slot to run in). Pure."""
        if self._lacks_slot(request):
            return 0
        if len(self.policies) == 1:
            return self.policies[0].num_fitting_tokens(request, wanted)
        return min((a.num_fitting_tokens(request, wanted) for a in self.policies), default=wanted)

    def allocate(self, request: Request, num_new_tokens: int) -> bool:
        """Pages for `num_new_tokens` more tokens in every group, and a slot for a request that holds
        none; False (nothing changed) if any group is full."""
        slots = self.slots
        if slots is None or slots.holds(request):
            return self._allocate_pages(request, num_new_tokens)
        if not slots.has_free() or not self._allocate_pages(request, num_new_tokens):
            return False
        slots.acquire(request)
        return True

    def _allocate_pages(self, request: Request, num_new_tokens: int) -> bool:
        if len(self.policies) == 1:  # one group: its own allocation is already check-then-commit
            return self.policies[0].allocate(request, num_new_tokens)
        if not all(a.can_allocate(request, num_new_tokens) for a in self.policies):
            return False
        for policy in self.policies:
            committed = policy.allocate(request, num_new_tokens)
            if not committed:  # hot path: no message built unless it fails
                raise InvariantError(f"group {policy.group} refused after can_allocate")
        return True

    def trim(self, request: Request, computed: int | None = None) -> int:
        """Step boundary: release pages the request's next step (from `computed`, None: its computed
        tokens; `PagePolicy.trim`) no longer reads. Returns how many."""
        return sum(a.trim(request, computed) for a in self._trimming) if self._trimming else 0

    def release_surplus(self, request: Request) -> int:
        """Speculation: give back every group's pages past the request's accepted KV. Returns how many."""
        return sum(policy.release_surplus(request) for policy in self.policies)

    def free(self, request: Request) -> None:
        """Release the request's pages in every group and its slot (a state without its KV is recomputed
        with it), and (sharing) its promises of pages not computed."""
        if self.prefix is not None:
            self.prefix.withdraw(request)
        for policy in self.policies:
            policy.free(request)
        if self.slots is not None:
            self.slots.release(request)

    # -- prefix sharing (prefix_cache.py); no-ops when it is off -------------------------------------
    def attach_prefix(self, request: Request) -> int:
        """Give a request that holds nothing its cached prefix pages; returns the tokens skipped."""
        return self.prefix.attach(request) if self.prefix is not None else 0

    def detach_prefix(self, request: Request) -> None:
        """Undo `attach_prefix` for a request that was not admitted after all."""
        if self.prefix is not None:
            self.prefix.detach(request)

    def promise(self, request: Request) -> None:
        """An admitted request will compute its full pages: same-prefix requests wait for them."""
        if self.prefix is not None:
            self.prefix.promise(request)

    def take_prefix_copies(self) -> list[PageCopy]:
        """The copies of this step's partial-page hits, for its plan (prefix_cache.py)."""
        return self.prefix.copies.take() if self.prefix is not None else []

    def prefix_copies_ran(self) -> None:
        """The plan holding the last `take_prefix_copies` has run: their source pages are no longer pinned."""
        if self.prefix is not None:
            self.prefix.copies.ran()

    def waits_for_pages(self, request: Request) -> bool:
        """True when a running request is computing the page after the request's hit."""
        return self.prefix is not None and self.prefix.waits_for_pages(request)

    def register(self, request: Request) -> None:
        """Key the pages a step completed (before a sliding group drops them)."""
        if self.prefix is not None:
            self.prefix.register(request)

    def weights_changed(self, version: int, running: list[Request]) -> None:
        """The model's weights are now version `version`: no page computed before may be hit (sharing on:
        every key dropped, the running requests' promises withdrawn; prefix_cache.py)."""
        if self.prefix is not None:
            self.prefix.weights_changed(version, running)

    def fork(self, parent: Request, child: Request) -> list[PageCopy] | None:
        """`child` shares `parent`'s prompt pages (sharing on); the copies to run, or None (no room)."""
        if self.prefix is None:
            raise InvariantError("fork without prefix sharing")
        return self.prefix.fork(parent, child)

    def copy_for_fork(self, parent: Request, child: Request) -> list[PageCopy] | None:
        """`child` gets copies of every page `parent` holds and of its slot (no sharing: a model with state
        layers, whose fork continues the parent's state, docs/state_layers.md) and its computed-token
        count; the copies to run (the slot's last, in the slot group), or None (nothing changed) when a
        group has too few free pages or no slot is free."""
        slots = self.slots
        if slots is not None and not slots.has_free():
            return None
        held = [policy.pages(parent) for policy in self.policies]
        if any(
            len(pages.page_ids) > policy.pool.num_free_pages
            for policy, pages in zip(self.policies, held, strict=True)
        ):
            return None
        copies: list[PageCopy] = []
        for g, (policy, source) in enumerate(zip(self.policies, held, strict=True)):
            # Only the pages the child's next step reads: the parent may still hold pages before its
            # window that its own step-boundary trim has not dropped yet (a sliding group).
            first = source.first_page
            if policy.trims:
                first = max(first, policy.first_needed_page(parent.num_computed_tokens))
            kept = source.page_ids[min(first - source.first_page, len(source.page_ids)) :]
            new_pages = policy.pool.allocate(len(kept)) or []
            copies.extend((g, src, dst) for src, dst in zip(kept, new_pages, strict=True))
            pages = policy.pages(child)
            pages.first_page, pages.page_ids = first, list(new_pages)
        child.num_computed_tokens = parent.num_computed_tokens
        if slots is not None:
            copies.append((self.slot_group, slots.slot_of(parent), slots.acquire(child)))
        return copies

    def unfittable_reason(self, num_tokens: int) -> str | None:
        """Why a request of `num_tokens` KV tokens can never run in this cache, or None if it can."""
        for policy, spec in zip(self.policies, self.specs, strict=True):
            needed = policy.max_pages(num_tokens)
            if needed > policy.pool.num_pages:
                where = f" in layer group {spec.name}" if len(self.specs) > 1 else ""
                return (
                    f"needs {needed} KV pages of {self.page_size} tokens{where} but the cache has only "
                    f"{policy.pool.num_pages}"
                )
        return None

    def describe_need(self, num_tokens: int) -> str:
        """`needed > available` pages per group, for error messages."""
        parts = [
            f"{a.max_pages(num_tokens)} > {a.pool.num_pages}"
            + (f" in {spec.name}" if len(self.specs) > 1 else "")
            for a, spec in zip(self.policies, self.specs, strict=True)
        ]
        return ", ".join(parts)

    @property
    def num_cached_pages(self) -> int:
        """Pages kept only for later prefix hits, all groups."""
        return sum(pool.num_cached_pages for pool in self.pools)

    @property
    def num_evictions(self) -> int:
        """Cached pages reallocated (their keys forgotten), all groups."""
        return sum(pool.num_evictions for pool in self.pools)

    def clear_prefix_cache(self) -> None:
        """Drop every cached page and reset the hit statistics (e.g. after a warmup)."""
        for pool in self.pools:
            pool.clear_cached()
        if self.prefix is not None:
            self.prefix.stats = PrefixStats()

    def pages_in_use(self) -> dict[str, int]:
        return {spec.name: a.pool.num_used_pages for a, spec in zip(self.policies, self.specs, strict=True)}

    def check_integrity(
        self, live: list[Request], running: list[Request], kept: list[list[list[int]]] | None = None
    ) -> None:
        """Every group's pool is consistent with the page lists of the live requests (and, per group,
        `kept`: the pages swapped-out requests still reference on the device, see offload.py); the slot
        group's with the running requests, each holding one."""
        for g, policy in enumerate(self.policies):
            tables = [policy.pages(r).page_ids for r in live]
            policy.pool.check_integrity(tables + (kept[g] if kept is not None else []))
        for request in running:
            for policy in self.policies:
                policy.check_request(request)
        if self.prefix is not None:
            self.prefix.check_integrity(running)
        if self.slots is not None:
            self.slots.check_integrity({request.request_id for request in running})
