"""The draft model (`assistant_model`) on its own paged cache: each step's draft tokens, before the schedule.

The engine calls `Drafter.draft(running)` before `Scheduler.schedule()`. For every decoding request that
speculates with the assistant (`SpeculationState.source` is a `ModelDraft`, scheduler/assisted.py) it

1. brings the request's *draft sequence* up to the target's tokens: a shadow `Request` on the drafter's
   own pages whose KV holds what the assistant computed. The target only appends tokens, so the shadow
   keeps the longest common prefix of what it computed and the request's tokens: the draft tokens the
   target accepted stay, the rejected ones are rolled back (`PageManager.release_surplus`,
   `BatchPacker.take_back`, as the target's own rejected KV), and the tokens after them (the target's own
   token, and on a first call the whole prompt) run as a catch-up chunk whose last row gives the first
   draft token;
2. runs one-token decode steps of the assistant, batched across requests, greedily (argmax), until each
   request has its `count` tokens, drew an eos (no draft goes past one), drew a token its assistant gives
   less than `confidence` probability (transformers' `assistant_confidence_threshold`), or ran out of
   the drafter's pages.

The draft is left in `ModelDraft.tokens`, where `propose` (scheduler/speculation.py) takes it. Drafts
are deterministic (q is one-hot), so the verification's rejection sampling keeps the target's
distribution exactly (sampling/verification.py). Shadows of requests that stopped running (finished,
failed, preempted) are freed (`forget`, and at the next `draft` for any the engine did not name). Pages
are never taken from the target: a request whose catch-up finds no page gets no draft this step.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from ..attention.selection import paged_attention
from ..kv.page_manager import PageManager
from ..requests import Request
from ..scheduler.assisted import ModelDraft
from ..scheduler.plan import ScheduledRequest, StepPlan
from .model_call import call_model
from .packing import BatchPacker

logger = logging.getLogger(__name__)


@dataclass
class DraftSequence:
    """The assistant's view of one request: `shadow` holds its tokens and KV (`num_computed_tokens`); the
    first `synced` of its tokens are the request's (the target only appends, so they stay right)."""

    shadow: Request
    synced: int


@dataclass
class PendingDraft:
    """One request's draft in progress this step."""

    request: Request
    sequence: DraftSequence
    source: ModelDraft
    count: int
    tokens: list[int] = field(default_factory=list)
    done: bool = False


def common_prefix(a: list[int], b: list[int], start: int, end: int) -> int:
    """The first index in [start, end) where `a` and `b` differ (`end` when none does)."""
    for i in range(start, min(end, len(a), len(b))):
        if a[i] != b[i]:
            return i
    return min(end, len(a), len(b))


class Drafter:
    """Args:
    model: the assistant (a causal LM with the target's vocabulary, full-attention or sliding KV only).
    pages: the drafter's own page pools and policies (one per assistant KV group).
    packer: packs its steps over its own `PagedKVCache` and block tables.
    max_batch_tokens: query tokens per assistant forward (catch-ups are chunked to it).
    attn_implementation: the paged backend the assistant runs under.
    select_rows: the assistant ignores `logits_to_keep` (runner/model_call.py).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        pages: PageManager,
        packer: BatchPacker,
        max_batch_tokens: int,
        attn_implementation: str,
        select_rows: bool = False,
    ) -> None:
        self.model = model
        self.pages = pages
        self.packer = packer
        self.max_batch_tokens = max_batch_tokens
        self.attn_implementation = attn_implementation
        self.select_rows = select_rows
        self.sequences: dict[str, DraftSequence] = {}
        self.forwards = 0  # assistant forwards run (catch-up chunks and draft steps)
        self._no_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=packer.device)

    # -- lifecycle of the shadows -------------------------------------------------------------
    def forget(self, requests: list[Request]) -> None:
        """`requests` stopped running (finished, failed, preempted): their shadows' pages go back."""
        for request in requests:
            self._drop(request.request_id)

    def reset(self) -> None:
        """Drop every shadow (after a failed draft: the next one starts from scratch)."""
        for request_id in list(self.sequences):
            self._drop(request_id)

    def _drop(self, request_id: str) -> None:
        sequence = self.sequences.pop(request_id, None)
        if sequence is not None:
            self.pages.free(sequence.shadow)
            self.packer.release_request(sequence.shadow)

    @property
    def num_used_pages(self) -> int:
        """The drafter's pages held by shadows now, every group together."""
        return sum(pool.num_used_pages for pool in self.pages.pools)

    @contextmanager
    def session(self) -> Iterator[None]:
        """The assistant under its paged backend for the block (what `draft` otherwise does per call)."""
        with paged_attention(self.model, self.attn_implementation):
            yield

    # -- one step's drafts ------------------------------------------------------------------------
    def draft_or_skip(self, running: list[Request]) -> None:
        """`draft`, where a failure only costs the drafts (a speed setting): logged, the drafter reset,
        and the step runs without them."""
        try:
            self.draft(running)
        except Exception:  # noqa: BLE001 - drafts are optional; the step goes on without them
            logger.exception("the assistant model's draft failed; this step runs without drafts")
            self.reset()
            for request in running:
                if request.speculation is not None and isinstance(request.speculation.source, ModelDraft):
                    request.speculation.source.tokens = []

    @torch.inference_mode()
    def draft(self, running: list[Request]) -> None:
        """Draft tokens for every decoding request of `running` that speculates with the assistant."""
        live = {request.request_id for request in running}
        for request_id in [key for key in self.sequences if key not in live]:
            self._drop(request_id)
        pending = []
        for request in running:
            state = request.speculation
            if state is None or not isinstance(state.source, ModelDraft):
                continue
            state.source.tokens = []
            # As the scheduler's `propose`: decoding, not paused, room for a draft before max_new_tokens.
            if request.num_remaining_tokens != 1 or not request.generated_ids or state.paused_steps:
                continue
            room = request.max_new_tokens - len(request.generated_ids) - 1
            count = min(state.num_tokens, room, self.max_batch_tokens - 1)
            if count > 0:
                pending.append(PendingDraft(request, self._sync(request), state.source, count))
        if not pending:
            return
        with self._attention():
            pending = self._catch_up(pending)
            self._draft_steps(pending)
        for item in pending:
            item.source.tokens = item.tokens
            self._trim(item.sequence)

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
            groups = range(len(self.packer.block_tables))
            self.packer.take_back(shadow, [shadow.group_pages(g).end_page for g in groups])
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

    def _trim(self, sequence: DraftSequence) -> None:
        """A sliding group's pages that no later step reads: those before the window of the earliest token a
        rollback can return to (the request's last one, run again when nothing was appended to it), not of
        the draft tokens past it."""
        shadow = sequence.shadow
        self.pages.trim(shadow, min(shadow.num_computed_tokens, sequence.synced - 1))

    def _take(self, item: PendingDraft, row: tuple[int, float]) -> None:
        """Append the assistant's token; the draft is done at its length, an eos, or low confidence."""
        token, probability = row
        item.tokens.append(token)
        if (
            len(item.tokens) >= item.count
            or token in item.request.eos_token_ids
            or probability < item.source.confidence
        ):
            item.done = True

    def _forward(self, entries: list[ScheduledRequest]) -> dict[str, tuple[int, float]]:
        """One assistant forward over `entries`; request id -> (argmax token, its probability) of each
        entry that reaches its shadow's last token."""
        self.forwards += 1
        step = self.packer.pack(StepPlan(entries=entries))
        keep = step.logits_indices
        if keep.numel() == 0:  # catch-up chunks only: keep one row so that shapes stay valid
            keep = torch.zeros(1, dtype=torch.int64, device=self.packer.device)
        logits = call_model(
            self.model.forward,
            step.input_ids,
            step.position_ids,
            self._no_mask,
            keep,
            step.metadata,
            self.select_rows,
        )
        if not step.sampling_entries:
            return {}
        probabilities, tokens = logits[: len(step.sampling_entries)].float().softmax(-1).max(-1)
        return {
            entry.request.request_id: (token, probability)
            for entry, token, probability in zip(
                step.sampling_entries, tokens.tolist(), probabilities.tolist(), strict=True
            )
        }

    @contextmanager
    def _attention(self) -> Iterator[None]:
        """The assistant's paged backend, switched here only when the caller's `session` did not."""
        if self.model.config._attn_implementation == self.attn_implementation:
            yield
            return
        with paged_attention(self.model, self.attn_implementation):
            yield

    def check_integrity(self) -> None:
        """The drafter's pools agree with its shadows' pages, its block-table rows with those pages, and each
        shadow holds what its KV needs (its window checked from the earliest token a rollback returns to,
        as `_trim` keeps it)."""
        shadows = [sequence.shadow for sequence in self.sequences.values()]
        self.pages.check_integrity(shadows, [])
        for sequence in self.sequences.values():
            shadow = sequence.shadow
            for policy in self.pages.policies:
                policy.check_request(shadow, min(shadow.num_computed_tokens, sequence.synced - 1))
        for tables in self.packer.block_tables:
            tables.check_integrity(shadows)
