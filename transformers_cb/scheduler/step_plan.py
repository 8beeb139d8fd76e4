"""The plan of one step: everything `Scheduler.schedule()` decided, as plain data (no tensor).

A `StepPlan` is the whole decision of a step, so that whoever executes it (the runner on
rank 0, and on every tensor-parallel follower from rank 0's step message) needs nothing else.
The runner executes it in this order:

1. `copies`: forks' copy-on-write page copies (and, for a model with state layers, state-slot copies:
   entries of the slot group, `PageManager.slot_group`). They read what the last forward wrote, which
   a swap of this step may move out or hand to another request, so they run first;
2. `swaps`: the host-tier swaps (`SwapPlan`, gathers before scatters, see memory/swap.py), the state
   slots' as one more group;
3. `taken_back`: the block-table columns of rejected draft tokens (speculation), whose pages the
   previous step's `Scheduler.update` gave back, forgotten (one rollback: the scheduler releases the
   pages, the plan carries what the rows forget);
4. `released`: the requests that stopped running since the previous plan (`Scheduler.ended`: ended in
   the previous step's update or by `Scheduler.finish` from any caller, preempted or failed in this
   schedule): their block-table rows given back before packing, and the draft model's shadows;
5. `encode`: the requests whose media the encoder turns into embedding rows this step (admitted with
   placeholders still to compute; scheduler/media_budget.py), before the forward reads them;
6. pack `entries` and run the forward.

`preempted` and `failed` tell the engine what happened to those requests (the failed ones are
already finished). Each entry is a `ScheduledRequest`: one request's share of the step (which
tokens it runs, and for a speculating request the draft tokens it verifies: scheduler/speculation/drafts.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..kv.page_keys import PageCopy
from ..kv.swap_plan import SwapPlan
from ..requests import Request


@dataclass(slots=True)
class ScheduledRequest:
    """`request` runs tokens [start, start + num_tokens) of `request.all_token_ids` this step; with a
    `draft` (speculation), its last `len(draft)` query tokens are those draft tokens, past the request's
    known tokens, and every one of them yields logits (verification, sampling/verification.py)."""

    request: Request
    start: int
    num_tokens: int
    draft: list[int] = field(default_factory=list)
    # The request's state slot (`PageManager.state_slot`) in a model with state layers; -1 otherwise.
    state_slot: int = -1

    @property
    def end(self) -> int:
        """One past the last query position (draft tokens included): the KV length of the step."""
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """True when this step runs the request's last known token, so it yields a new one."""
        return self.end - len(self.draft) == self.request.num_tokens

    @property
    def token_ids(self) -> list[int]:
        """The step's query tokens: known tokens, then the draft."""
        if not self.draft:
            return self.request.all_token_ids[self.start : self.end]
        return [*self.request.all_token_ids[self.start : self.end - len(self.draft)], *self.draft]


@dataclass(slots=True)
class TakeBack:
    """A speculating request gave back the pages of its rejected draft tokens: in each KV group `g`, its
    block-table row forgets the columns from logical page `end_pages[g]` on (rewritten when pages are
    appended again). The end pages are those right after the release: the same schedule may append
    pages again before the runner executes the plan."""

    request: Request
    end_pages: tuple[int, ...]


@dataclass
class StepPlan:
    """The whole decision of one step (see the module docstring for the order it is executed in)."""

    entries: list[ScheduledRequest]
    preempted: list[Request] = field(default_factory=list)
    failed: list[Request] = field(default_factory=list)
    # Copies (forks' copy-on-write pages; state slots in the slot group) to run before anything else.
    copies: list[PageCopy] = field(default_factory=list)
    # The host-tier swaps of this schedule, state slots included (None: no host tier).
    swaps: SwapPlan | None = None
    # Requests that stopped running since the previous plan (`Scheduler.ended`): their block-table rows
    # go back before packing, the draft model forgets their shadows.
    released: list[Request] = field(default_factory=list)
    # Speculation's rollbacks since the previous plan: block-table columns to forget, before `released`.
    taken_back: list[TakeBack] = field(default_factory=list)
    # Requests whose media are encoded into the embedding store before this step's forward.
    encode: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(entry.num_tokens for entry in self.entries)
