"""The draft model (`assistant_model`) as a draft source: its shadows' decisions, torch-free.

Before each schedule the engine asks its draft sources for drafts (drafts.py); for every decoding request
that speculates with the assistant (`SpeculationState.source` is this planner) the planner

1. brings the request's *draft sequence* up to the target's tokens: a shadow `Request` on the drafter's
   own pages whose KV holds what the assistant computed. The target only appends tokens, so the shadow
   keeps the longest common prefix of what it computed and the request's tokens: the draft tokens the
   target accepted stay, the rejected ones are rolled back (`PageManager.release_surplus` here, the
   block-table columns by the executor, as the target's own rejected KV), and the tokens after them (the
   target's own token, and on a first call the whole prompt) run as a catch-up chunk whose last row
   gives the first draft token;
2. plans one-token decode steps of the assistant, batched across requests, greedily (argmax), until each
   request has its `count` tokens, drew an eos (no draft goes past one), drew a token its assistant gives
   less than `confidence` probability (transformers' `assistant_confidence_threshold`), or ran out of
   the drafter's pages.

Every forward is the executor's (`DraftExecutor`: runner/drafter.py, the assistant on its own paged
cache), which only runs what the planner hands it: entries, rows to release, columns to take back. Drafts
are deterministic (q is one-hot), so the verification's rejection sampling keeps the target's
distribution exactly (sampling/verification.py). Shadows of requests that stopped running (finished,
failed, preempted) are freed (`forget`, and at the next `propose` for any the engine did not name).
Pages are never taken from the target: a request whose catch-up finds no page gets no draft this step.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from ...kv.page_manager import PageManager
from ...requests import Request
from ..step_plan import ScheduledRequest
from .assisted import after_verify
from .back_off import draft_room, follow_schedule, speculation_of
from .draft_source import Drafts

logger = logging.getLogger(__name__)


class DraftExecutor(Protocol):
    """What runs the planner's decisions on the device (runner/drafter.py `Drafter`)."""

    def forward(self, entries: list[ScheduledRequest]) -> dict[str, tuple[int, float]]:
        """One assistant forward over `entries`; request id -> (argmax token, its probability) of each
        entry that reaches its shadow's last token."""
        ...

    def release(self, shadow: Request) -> None:
        """`shadow`'s block-table rows go back (its pages were freed)."""
        ...

    def take_back(self, shadow: Request, end_pages: Sequence[int]) -> None:
        """`shadow` gave pages back from its end: its rows forget the columns from `end_pages[g]` on."""
        ...

    def attention(self) -> AbstractContextManager[None]:
        """The assistant under its paged backend for the block."""
        ...

    def check_rows(self, shadows: list[Request]) -> None:
        """The block-table rows agree with `shadows`' pages (raises `InvariantError`)."""
        ...


Executor = TypeVar("Executor", bound=DraftExecutor)


@dataclass
class DraftSequence:
    """The assistant's view of one request: `shadow` holds its tokens and KV (`num_computed_tokens`); the
    first `synced` of its tokens are the request's (the target only appends, so they stay right)."""

    shadow: Request
    synced: int

    @property
    def rollback_bound(self) -> int:
        """The earliest token a rollback can return to (the request's last one, run again when nothing
        was appended to it): a sliding group keeps its window, not the draft tokens' past it."""
        return min(self.shadow.num_computed_tokens, self.synced - 1)


@dataclass
class PendingDraft:
    """One request's draft in progress this step."""

    request: Request
    sequence: DraftSequence
    count: int
    confidence: float
    tokens: list[int] = field(default_factory=list)
    done: bool = False


def common_prefix(a: list[int], b: list[int], start: int, end: int) -> int:
    """The first index in [start, end) where `a` and `b` differ (`end` when none does)."""
    for i in range(start, min(end, len(a), len(b))):
        if a[i] != b[i]:
            return i
    return min(end, len(a), len(b))


class ShadowPlanner(Generic[Executor]):
    """The draft model's `DraftSource`. Args:
    pages: the drafter's own page pools and policies (one per assistant KV group).
    executor: runs the assistant's forwards and block-table rows (runner/drafter.py).
    max_batch_tokens: query tokens per assistant forward (catch-ups are chunked to it).
    """

    def __init__(self, pages: PageManager, executor: Executor, max_batch_tokens: int) -> None:
        self.pages = pages
        self.executor = executor
        self.max_batch_tokens = max_batch_tokens
        self.sequences: dict[str, DraftSequence] = {}
        self.forwards = 0  # assistant forwards run (catch-up chunks and draft steps)

    # -- lifecycle of the shadows -------------------------------------------------------------
    def stopped(self, request: Request) -> None:
        """`request` stopped running (finished, failed, cancelled, preempted; the scheduler says so as it
        adds it to `Scheduler.ended`): its shadow's pages go back."""
        self._drop(request.request_id)

    def reset(self) -> None:
        """Drop every shadow (after a failed draft: the next one starts from scratch)."""
        for request_id in list(self.sequences):
            self._drop(request_id)

    def _drop(self, request_id: str) -> None:
        sequence = self.sequences.pop(request_id, None)
        if sequence is not None:
            self.pages.free(sequence.shadow)
            self.executor.release(sequence.shadow)

    @property
    def num_used_pages(self) -> int:
        """The drafter's pages held by shadows now, every group together."""
        return sum(pool.num_used_pages for pool in self.pages.pools)

    # -- the draft source ---------------------------------------------------------------------------
    def propose(self, requests: Sequence[Request]) -> Drafts:
        """`draft`, where a failure only costs the drafts (a speed setting): logged, the shadows reset,
        and the step runs without them."""
        try:
            return self.draft(requests)
        except Exception:  # noqa: BLE001 - drafts are optional; the step goes on without them
            logger.exception("the assistant model's draft failed; this step runs without drafts")
            self.reset()
            return {}

    def after_verify(self, request: Request, drafted: int, accepted: int) -> None:
        """The request's draft length under transformers' schedules (assisted.py `after_verify`)."""
        state = speculation_of(request)
        if state is not None:
            follow_schedule(state, after_verify(state.assistant, drafted, accepted))

    def draft(self, requests: Sequence[Request]) -> Drafts:
        """Draft tokens for every request of `requests` (the running ones) that speculates with the
        assistant and may draft now (`draft_room`)."""
        live = {request.request_id for request in requests}
        for request_id in [key for key in self.sequences if key not in live]:
            self._drop(request_id)
        pending = []
        for request in requests:
            state = speculation_of(request)
            if state is None or state.source is not self:
                continue
            count = min(draft_room(request), self.max_batch_tokens - 1)
            if count > 0:
                pending.append(PendingDraft(request, self._sync(request), count, state.assistant.confidence))
        if not pending:
            return {}
        with self.executor.attention():
            pending = self._catch_up(pending)
            self._draft_steps(pending)
        for item in pending:
            self._trim(item.sequence)
        return {item.request.request_id: item.tokens for item in pending}

    def _sync(self, request: Request) -> DraftSequence:
        """The request's shadow, rolled back to the KV that is still the request's, its tokens the request's."""
        tokens = request.all_token_ids
        sequence = self.sequences.get(request.request_id)
        if sequence is None:
            shadow = Request(request_id=request.request_id, prompt_ids=list(tokens), max_new_tokens=1)
            sequence = self.sequences[request.request_id] = DraftSequence(shadow, len(tokens))
            return sequence
        shadow = sequence.shadow
        kept = common_prefix(shadow.all_token_ids, tokens, sequence.synced, shadow.num_computed_tokens)
        # The last token runs in every catch-up: its row gives the first draft token.
        kept = min(kept, len(tokens) - 1)
        if kept < shadow.num_computed_tokens:  # rejected draft tokens: their KV goes
            shadow.num_computed_tokens = kept
            self.pages.release_surplus(shadow)
            groups = range(len(self.pages.policies))
            self.executor.take_back(shadow, [shadow.group_pages(g).end_page for g in groups])
        del shadow.all_token_ids[kept:]
        shadow.all_token_ids.extend(tokens[kept:])
        sequence.synced = len(tokens)
        return sequence

    def _catch_up(self, pending: list[PendingDraft]) -> list[PendingDraft]:
        """Run each shadow's tokens not computed yet (chunks, at most `max_batch_tokens` per forward); the
        last row of each gives its first draft token. Returns the drafts that got one (a shadow that finds
        no page is dropped: no draft for its request this step)."""
        drafting: list[PendingDraft] = []
        waiting = list(pending)
        while waiting:
            budget, entries, chunked, left = self.max_batch_tokens, [], [], []
            for item in waiting:
                shadow = item.sequence.shadow
                if budget == 0:
                    left.append(item)
                    continue
                num_tokens = self.pages.num_fitting_tokens(shadow, min(shadow.num_remaining_tokens, budget))
                if num_tokens == 0:
                    self._drop(item.request.request_id)
                    continue
                self.pages.allocate(shadow, num_tokens)
                entries.append(ScheduledRequest(shadow, shadow.num_computed_tokens, num_tokens))
                chunked.append(item)
                budget -= num_tokens
            if entries:
                rows = self._forward(entries)
                for item, entry in zip(chunked, entries, strict=True):
                    shadow = item.sequence.shadow
                    shadow.num_computed_tokens = entry.end
                    self._trim(item.sequence)
                    if shadow.request_id in rows:
                        self._take(item, rows[shadow.request_id])
                        drafting.append(item)
                    else:
                        left.append(item)
            waiting = left
        return drafting

    def _draft_steps(self, drafting: list[PendingDraft]) -> None:
        """One-token assistant steps, all unfinished drafts batched, until every draft is done. Each step
        writes the previous draft token's KV (rolled back at the next `draft` if the target rejects it)."""
        active = [item for item in drafting if not item.done]
        while active:
            entries, stepping = [], []
            for item in active:
                shadow = item.sequence.shadow
                if not self.pages.allocate(shadow, 1):
                    item.done = True  # no page for one more token: the draft ends here
                    continue
                shadow.all_token_ids.append(item.tokens[-1])
                entries.append(ScheduledRequest(shadow, shadow.num_computed_tokens, 1))
                stepping.append(item)
            if not entries:
                return
            rows = self._forward(entries)
            for item, entry in zip(stepping, entries, strict=True):
                item.sequence.shadow.num_computed_tokens = entry.end
                self._take(item, rows[item.request.request_id])
            active = [item for item in stepping if not item.done]

    def _forward(self, entries: list[ScheduledRequest]) -> dict[str, tuple[int, float]]:
        self.forwards += 1
        return self.executor.forward(entries)

    def _trim(self, sequence: DraftSequence) -> None:
        """A sliding group's pages that no later step reads: those before the window of the earliest token a
        rollback can return to, not of the draft tokens past it."""
        self.pages.trim(sequence.shadow, sequence.rollback_bound)

    def _take(self, item: PendingDraft, row: tuple[int, float]) -> None:
        """Append the assistant's token; the draft is done at its length, an eos, or low confidence."""
        token, probability = row
        item.tokens.append(token)
        if (
            len(item.tokens) >= item.count
            or token in item.request.eos_token_ids
            or probability < item.confidence
        ):
            item.done = True

    def check_integrity(self) -> None:
        """The drafter's pools agree with its shadows' pages, its block-table rows with those pages, and each
        shadow holds what its KV needs (its window checked from the earliest token a rollback returns to,
        as `_trim` keeps it)."""
        shadows = [sequence.shadow for sequence in self.sequences.values()]
        self.pages.check_integrity(shadows, [])
        for sequence in self.sequences.values():
            for policy in self.pages.policies:
                policy.check_request(sequence.shadow, sequence.rollback_bound)
        self.executor.check_rows(shadows)
