"""Prefix sharing: content keys of full pages, prefix hits at admission, and forks.

Every full page of a sequence gets a key chained over the whole prefix:
`key(i) = blake2b(key(i - 1) + token ids of page i)` (16 bytes; page 0 chains from
`ROOT_KEY`). Equal keys mean equal tokens from position 0 to the end of the
page, so equal KV in every layer of a group. Each KV group has its own pool,
so a key is per group by construction. A pool also records each keyed page's
parent key and tokens, and a hit is verified against them before use.

- `register` gives the pages a step completed their keys (all groups);
- `promise` records, at admission, the full pages a request is about to compute, so that a
  request with the same prefix waits for them (`waits_for_pages`) instead of computing them
  again in the same steps: requests submitted together then share their common prefix too;
- `attach` lets a request that starts from scratch (new, or preempted and back)
  take every page it can reuse with a refcount and skip their prefill; it never
  takes the page holding its last token, so that token is computed and has logits;
- partial pages: a page's first tokens, in steps of `PARTIAL_STEP`, get *partial* keys too
  (`partial_key`: a page being filled as its request runs, and every full page), and a request whose
  next page after its full-page hit starts with such tokens gets a page of its own holding a copy of
  that page (`PageCopy`, run before the next forward; the source is pinned until the copy has run) and
  skips those tokens: prompts that share a system prompt shorter than a page (256 tokens by default) share
  it too. One group of full attention, no media (`PrefixCache.partial`);
- `fork` makes a sibling (`num_return_sequences`) of a request that just
  computed its prompt: the siblings share the prompt's full pages and get a
  private copy of the page holding the last prompt token, which they recompute.

A request only ever writes KV at positions >= its `num_computed_tokens`, and
shared pages all lie before that, so shared pages are read-only.

A key also stands for the weights the page was computed with: when they change (`weights_changed`, a
new weight version) every page loses its key, cached or in use, and the promises of pages still being
computed are withdrawn. A request whose KV dates from an older version (`Request.kv_version`: kept
across the update by `pause(mode="keep")`) keys and promises nothing any more: its later pages attend
to stale KV, so they are not what a fresh computation of their tokens would give.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from ..invariants import InvariantError
from ..requests import Request
from .page_keys import PARTIAL_STEP, PageCopy, partial_key, request_keys, root_key
from .page_policies import PagePolicy
from .partial_copies import PartialCopies
from .rope_rule import RopeRule


@dataclass
class PrefixStats:
    """Lookups at admission: tokens the requests had to compute, and how many were found cached."""

    lookup_tokens: int = 0
    hit_tokens: int = 0
    forks: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0


class PrefixCache:
    """Prefix sharing over the page policies of every KV layer group (one pool each)."""

    def __init__(self, policies: list[PagePolicy], rope: RopeRule | None = None) -> None:
        self.policies = policies
        # A dynamic rotary embedding's rule (kv/rope_rule.py): it salts each request's keys.
        self.rope = rope
        self.page_size = policies[0].page_size
        self.stats = PrefixStats()
        self._in_flight: dict[bytes, int] = {}  # key -> running requests about to compute that page
        self.weight_version = 0  # the weights the keyed pages were computed with (`weights_changed`)
        self.dropped_keys = 0  # pages that lost their key to a weight update, since creation
        # Partial pages: one group that keeps every page (sliding groups would need each group's window).
        self.partial = len(policies) == 1 and not policies[0].trims
        self.copies = PartialCopies(policies[0].pool)  # partial hits' copies, their sources pinned until run
        # Partial pages being computed: (parent key, the page's first PARTIAL_STEP tokens) -> {request id: the
        # tokens it computes in that page}, and per request those index keys and the token count that settles
        # them. A waiting request compares itself only with promises of its own first tokens.
        self._partial_promises: dict[tuple[bytes, tuple[int, ...]], dict[str, tuple[int, ...]]] = {}
        self._promised_parents: dict[str, tuple[list[tuple[bytes, tuple[int, ...]]], int]] = {}

    # -- keys ------------------------------------------------------------------------------------
    def _salt(self, request: Request) -> bytes:
        # A request on an adapter (docs/adapters.md) chains from a root of its adapter and version: no hit
        # across adapters, hits within one.
        adapter = request.adapter.salt() if request.adapter is not None else b""
        if self.rope is None:
            return adapter
        return adapter + self.rope.prefix_salt(request.num_prompt_tokens, request.num_tokens)

    def _keys(self, request: Request, num_pages: int) -> list[bytes]:
        salt = self._salt(request)
        return request_keys(request, num_pages, self.page_size, salt)

    def _content(self, request: Request, keys: list[bytes], i: int) -> tuple[bytes, bytes, tuple[int, ...]]:
        ps = self.page_size
        return (
            keys[i],
            keys[i - 1] if i else root_key(self._salt(request)),
            tuple(request.all_token_ids[i * ps : (i + 1) * ps]),
        )

    def current(self, request: Request) -> bool:
        """Whether the request's KV was computed with the current weights (else its pages are never keyed)."""
        return request.kv_version is None or request.kv_version == self.weight_version

    def weights_changed(self, version: int, running: list[Request]) -> None:
        """The weights are now version `version`: every page loses its key (cached ones are freed), and
        the running requests' promises of pages being computed are withdrawn: no later request may hit a
        page computed before."""
        self.weight_version = version
        for request in running:
            self.withdraw(request)
        self.dropped_keys += sum(policy.pool.forget_keys() for policy in self.policies)

    def register(self, request: Request) -> None:
        """Key the pages that became full since the last call (before a sliding group drops them). Those
        of a request whose KV is older than the weights are not keyed."""
        if not self.current(request):
            return
        num_full = request.num_computed_tokens // self.page_size
        partial = self.partial and request.media is None
        if num_full > request.num_registered_pages:
            keys = self._keys(request, num_full)
            for i in range(request.num_registered_pages, num_full):
                key, parent, tokens = self._content(request, keys, i)
                if i < request.num_promised_pages:
                    self._settle(key)
                for policy in self.policies:
                    pages = policy.pages(request)
                    if pages.first_page <= i < pages.end_page:
                        policy.pool.register(pages.page_ids[i - pages.first_page], key, parent, tokens)
                if partial:
                    self._register_partial(request, i, self.page_size - PARTIAL_STEP)
            request.num_registered_pages = num_full
        if partial:
            filled = request.num_computed_tokens - num_full * self.page_size
            self._register_partial(request, num_full, filled // PARTIAL_STEP * PARTIAL_STEP)
            promised = self._promised_parents.get(request.request_id)
            if promised is not None and request.num_computed_tokens >= promised[1]:
                self._settle_partial(request)

    def _register_partial(self, request: Request, i: int, tokens: int) -> None:
        """Partial keys for the first `PARTIAL_STEP`, 2 x ... up to `tokens` tokens of the request's page `i`
        (those keyed before skipped)."""
        page, done = request.partial_keyed
        first = done + PARTIAL_STEP if page == i else PARTIAL_STEP
        if first > tokens:
            return
        pages = self.policies[0].pages(request)
        if not pages.first_page <= i < pages.end_page:
            return
        page_id = pages.page_ids[i - pages.first_page]
        parent = self._keys(request, i)[i - 1] if i else root_key(self._salt(request))
        start = i * self.page_size
        for n in range(first, tokens + 1, PARTIAL_STEP):
            content = tuple(request.all_token_ids[start : start + n])
            self.policies[0].pool.register_partial(page_id, partial_key(parent, content), parent, content)
        request.partial_keyed = (i, tokens)

    # -- pages being computed ---------------------------------------------------------------------
    def promise(self, request: Request) -> None:
        """An admitted request will compute its full pages from `num_registered_pages` on (none when its
        KV is older than the weights: they will not be keyed)."""
        if not self.current(request):
            return
        num_full = request.num_tokens // self.page_size
        for key in self._keys(request, num_full)[request.num_registered_pages :]:
            self._in_flight[key] = self._in_flight.get(key, 0) + 1
        request.num_promised_pages = num_full
        if self.partial and request.media is None:
            self._promise_partial(request)

    def _promise_partial(self, request: Request) -> None:
        """Record the tokens the request computes in each page from its hit on, so that a request sharing
        part of one waits for its partial keys (`waits_for_pages`) instead of computing them too."""
        ps = self.page_size
        first, end = request.num_computed_tokens // ps, request.num_tokens
        parents = []
        for i in range(first, (end - 1) // ps + 1):
            tokens = tuple(request.all_token_ids[i * ps : min(end, (i + 1) * ps)])
            if len(tokens) < PARTIAL_STEP:
                break
            index = (self._parent(request, i), tokens[:PARTIAL_STEP])
            self._partial_promises.setdefault(index, {})[request.request_id] = tokens
            parents.append(index)
        if parents:
            self._promised_parents[request.request_id] = (parents, end)

    def _settle_partial(self, request: Request) -> None:
        entry = self._promised_parents.pop(request.request_id, None)
        for index in entry[0] if entry is not None else ():
            promised = self._partial_promises[index]
            del promised[request.request_id]
            if not promised:
                del self._partial_promises[index]

    def _parent(self, request: Request, i: int) -> bytes:
        """The key page `i` of the request chains from."""
        return self._keys(request, i)[i - 1] if i else root_key(self._salt(request))

    def withdraw(self, request: Request) -> None:
        """The request stops (preempted or ended): its pages not computed yet are no longer coming (nor its
        partial hit's copy, if the plan has not taken it yet)."""
        for key in request.page_keys[request.num_registered_pages : request.num_promised_pages]:
            self._settle(key)
        request.num_promised_pages = 0
        self.copies.drop(request.request_id)
        self._settle_partial(request)
        request.partial_keyed = (-1, 0)

    def waits_for_pages(self, request: Request) -> bool:
        """True when the page after the request's hit is being computed by a running request."""
        next_page = request.num_computed_tokens // self.page_size
        if self.partial and request.media is None and self._waits_for_partial(request, next_page):
            return True
        if next_page >= (request.num_tokens - 1) // self.page_size:
            return False
        keys = self._keys(request, next_page + 1)
        return keys[next_page] in self._in_flight

    def _waits_for_partial(self, request: Request, i: int) -> bool:
        """Whether a running request is computing more of page `i`'s first tokens, as this request has them,
        than its hit gave it (at least `PARTIAL_STEP` more, never its last token)."""
        start, have = i * self.page_size, request.num_computed_tokens
        # the tokens a copy would have to give it: its hit's and PARTIAL_STEP more (never its last token)
        need = (have - start) // PARTIAL_STEP * PARTIAL_STEP + PARTIAL_STEP
        if start + need > min(request.num_tokens - 1, start + self.page_size - 1):
            return False
        mine = tuple(request.all_token_ids[start : start + need])
        promised = self._partial_promises.get((self._parent(request, i), mine[:PARTIAL_STEP]))
        return promised is not None and any(tokens[:need] == mine for tokens in promised.values())

    def check_integrity(self, running: list[Request]) -> None:
        """Pages promised are exactly the running requests' uncomputed full pages; keys match pools."""
        expected: dict[bytes, int] = {}
        for request in running:
            for key in request.page_keys[request.num_registered_pages : request.num_promised_pages]:
                expected[key] = expected.get(key, 0) + 1
            if request.num_registered_pages > request.num_computed_tokens // self.page_size:
                raise InvariantError(f"{request.request_id}: keyed pages not computed yet")
        if expected != self._in_flight:
            raise InvariantError("pages in flight disagree with the running requests' promises")
        if not set(self._promised_parents) <= {request.request_id for request in running}:
            raise InvariantError("a partial page is promised by a request that does not run")

    def _settle(self, key: bytes) -> None:
        remaining = self._in_flight[key] - 1
        if remaining:
            self._in_flight[key] = remaining
        else:
            del self._in_flight[key]

    # -- hits --------------------------------------------------------------------------------------
    def attach(self, request: Request) -> int:
        """Give a request that holds nothing the cached pages of its longest reusable prefix.

        The prefix is the longest run of full pages such that every group has what the next
        query needs: all of its pages for a full-attention group, the pages of the last window for
        a sliding one. Returns the tokens skipped (`request.num_computed_tokens` afterwards).
        """
        if request.num_computed_tokens or request.holds_pages:
            raise InvariantError(f"{request.request_id}: prefix lookup on a request that holds KV")
        self.stats.lookup_tokens += request.num_tokens
        # The page holding the last token is never taken: that token must run to give logits.
        max_pages = (request.num_tokens - 1) // self.page_size
        num_pages = self._attach_pages(request, max_pages) if max_pages else 0
        copied = self._attach_partial(request, num_pages)
        self.stats.hit_tokens += num_pages * self.page_size + copied
        return request.num_computed_tokens

    def _attach_pages(self, request: Request, max_pages: int) -> int:
        """`attach`'s whole cached pages: how many the request took."""
        keys = self._keys(request, max_pages)
        found: list[dict[int, int | None]] = [{} for _ in self.policies]

        def find(g: int, i: int) -> int | None:
            if i not in found[g]:
                found[g][i] = self.policies[g].pool.lookup(*self._content(request, keys, i))
            return found[g][i]

        limit = max_pages
        for g, policy in enumerate(self.policies):
            if not policy.trims:  # every page from 0 on
                n = 0
                while n < limit and find(g, n) is not None:
                    n += 1
                limit = n
        num_pages = 0
        for h in range(limit, 0, -1):
            if all(
                all(find(g, i) is not None for i in range(a.first_needed_page(h * self.page_size), h))
                for g, a in enumerate(self.policies)
            ):
                num_pages = h
                break
        if num_pages == 0:
            return 0
        num_tokens = num_pages * self.page_size
        for g, policy in enumerate(self.policies):
            first = policy.first_needed_page(num_tokens)
            page_ids = [cast(int, found[g][i]) for i in range(first, num_pages)]  # all found above
            for page_id in page_ids:
                policy.pool.acquire(page_id)
            pages = policy.pages(request)
            pages.first_page, pages.page_ids = first, page_ids
        request.num_computed_tokens = num_tokens
        request.num_registered_pages = num_pages
        return num_pages

    def _attach_partial(self, request: Request, num_pages: int) -> int:
        """After `num_pages` whole pages: a page of the request's own holding a copy of the longest cached
        partial page its next tokens start with (never its last token); how many tokens it skips."""
        if not self.partial or request.media is not None:
            return 0
        start = num_pages * self.page_size
        room = min(request.num_tokens - 1 - start, self.page_size - 1) // PARTIAL_STEP * PARTIAL_STEP
        if room <= 0:
            return 0
        policy = self.policies[0]
        pool = policy.pool
        parent = self._keys(request, num_pages)[num_pages - 1] if num_pages else root_key(self._salt(request))
        source = None
        for n in range(room, 0, -PARTIAL_STEP):
            content = tuple(request.all_token_ids[start : start + n])
            source = pool.lookup_partial(partial_key(parent, content), parent, content)
            if source is not None:
                break
        if source is None:
            return 0
        pool.pin(source)  # not taken by the allocation below, nor by any until the copy has run
        allocated = pool.allocate(1)
        if not allocated:
            pool.unpin(source)
            return 0
        pages = policy.pages(request)
        if not num_pages:
            pages.first_page, pages.page_ids = 0, []
        pages.page_ids.append(allocated[0])
        self.copies.add(request.request_id, (policy.group, source, allocated[0]))
        request.num_computed_tokens = start + n
        return n

    def detach(self, request: Request) -> None:
        """Undo `attach` for a request that was not admitted after all (its pages stay cached)."""
        self.stats.hit_tokens -= request.num_computed_tokens
        self.stats.lookup_tokens -= request.num_tokens
        self.copies.drop(request.request_id)
        for policy in self.policies:
            policy.free(request)
        request.num_computed_tokens = 0
        request.num_registered_pages = 0

    # -- forks -------------------------------------------------------------------------------------
    def fork(self, parent: Request, child: Request) -> list[PageCopy] | None:
        """Make `child` continue from `parent`'s prompt minus its last token: share the full pages
        before it, copy the page holding it. Call right after the parent's step that computed its
        last prompt token. Returns the copies to run before the next forward, or None (nothing
        changed) when a group has no page for the copy."""
        last = parent.num_prompt_tokens - 1
        copied = last // self.page_size  # logical page holding the last prompt token
        if parent.num_computed_tokens <= last:
            raise InvariantError(f"{parent.request_id}: forked before its prompt was computed")
        if any(a.pool.num_free_pages < 1 for a in self.policies):
            return None
        copies: list[PageCopy] = []
        for g, policy in enumerate(self.policies):
            source = policy.pages(parent)
            first = max(source.first_page, policy.first_needed_page(last))
            shared = source.page_ids[first - source.first_page : copied - source.first_page]
            policy.pool.share(shared)
            (new_page,) = cast(list[int], policy.pool.allocate(1))  # every pool has a free page
            copies.append((g, source.page_ids[copied - source.first_page], new_page))
            pages = policy.pages(child)
            pages.first_page, pages.page_ids = first, [*shared, new_page]
        child.num_computed_tokens = last
        child.num_registered_pages = copied
        child.page_keys = list(parent.page_keys[:copied])
        self.stats.forks += 1
        return copies
