"""One scheduler for the whole TP group: rank 0 decides each step, the other ranks replay it.

Rank 0 (the driver) runs the scheduler, the request queue, sampling and the manager. At every
`Engine.step()` it sends one `StepMessage` over the CPU group: the tokens it sampled and the
requests that ended since the last message, the first-seen requests' prompts, and this step's
whole plan (`StepPlan`): entries (request, first token, token count, page ids), fork page
copies, host-tier swaps, block-table rows to release. Every other rank (a follower) applies the
message to its mirror of the requests and its runner executes the same plan over the same pages
of its own cache shard (its host tier has as many pages as rank 0's: `agree_host_pages`), so the
KV shards stay in step and the model's collectives line up.

Tokens are sampled on rank 0 only and reach the followers in the next message: identical on every
rank without relying on bit-identical logits across ranks or on RNG state kept in step (a
follower's forward still computes logits, discarded). Followers never decide anything, so
scheduler state cannot diverge; a follower that sees a different prompt for a request id than
its own (`generate_batch` called with different inputs) raises.

Message kinds: STEP (entries to run, possibly none), IDLE (a manager with no work, sent every
loop tick so the followers' collective never waits long), END (a run of `generate_batch` or of
a warmup drained: followers' `has_work()` turns False), STOP (the manager's session ended).
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field

import torch.distributed as dist
from transformers import PreTrainedModel

from ..kv.swap_plan import SwapPlan
from ..memory.sizing import Sizing
from ..requests import AdapterChoice, PageList, Request, RequestStatus
from ..sampling.sampled_token import SampledToken
from ..scheduler.step_plan import ScheduledRequest, StepPlan
from .cpu_group import CpuGroup, TensorParallelError
from .sharding import is_distributed, tp_process_group, tp_size_of

logger = logging.getLogger(__name__)


class Kind(enum.IntEnum):
    STEP = 0
    IDLE = 1
    END = 2
    STOP = 3


@dataclass(frozen=True)
class RequestSpec:
    """What a follower needs to mirror a request it has not seen."""

    request_id: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    eos_token_ids: tuple[int, ...]
    record_timestamps: bool
    adapter: AdapterChoice | None = None  # its rows' adapters in every rank's forward (docs/adapters.md)

    @classmethod
    def of(cls, request: Request) -> RequestSpec:
        return cls(
            request.request_id,
            tuple(request.prompt_ids),
            request.max_new_tokens,
            tuple(sorted(request.eos_token_ids)),
            request.record_timestamps,
            request.adapter,
        )

    def build(self) -> Request:
        return Request(
            request_id=self.request_id,
            prompt_ids=list(self.prompt_ids),
            max_new_tokens=self.max_new_tokens,
            eos_token_ids=frozenset(self.eos_token_ids),
            record_timestamps=self.record_timestamps,
            adapter=self.adapter,
        )


@dataclass
class StepMessage:
    kind: Kind
    tokens: list[tuple[str, SampledToken]] = field(
        default_factory=list
    )  # (request id, token) since last message
    finals: list[tuple[str, int, str | None, str | None]] = field(
        default_factory=list
    )  # status, reason, error
    released: list[str] = field(default_factory=list)  # pages freed in the schedule: rows go back
    new: list[RequestSpec] = field(default_factory=list)
    # id, start, n, and per KV layer group (first logical page, page ids)
    entries: list[tuple[str, int, int, list[tuple[int, list[int]]]]] = field(default_factory=list)
    copies: list[tuple[int, int, int]] = field(default_factory=list)  # forks' page copies, run first
    swaps: SwapPlan | None = None  # the host-tier swaps, run after the copies


class TensorParallelCoordinator:
    """Args:
    model: a model sharded by transformers (`tp_size` > 1, torch.distributed initialized).
    timeout: `cpu_group_timeout` in seconds (None: none).
    """

    def __init__(self, model: PreTrainedModel, timeout: float | None) -> None:
        self.tp_size = tp_size_of(model)
        model_group = tp_process_group(model)
        ranks = dist.get_process_group_ranks(model_group)
        self.cpu = CpuGroup(ranks, timeout, model_group)
        self.is_driver = self.cpu.is_root
        self.rank = self.cpu.rank
        self._pending = StepMessage(Kind.STEP)  # driver: what the next message carries
        self._known: set[str] = set()  # driver: ids the followers mirror
        self.requests: dict[str, Request] = {}  # follower: the mirror
        self.run_ended = True  # follower: no run in progress (an END arrived and nothing was added since)
        self.stopped = False  # follower: a STOP arrived

    @classmethod
    def for_model(cls, model: PreTrainedModel, timeout: float | None) -> TensorParallelCoordinator | None:
        if tp_size_of(model) == 1:
            return None
        if not is_distributed():
            raise ValueError("the model has tp_size > 1 but torch.distributed is not initialized")
        return cls(model, timeout)

    def agree_sizing(self, sizing: Sizing) -> Sizing:
        """Every rank sizes its cache from its own free memory; all use the smallest, so rank 0's
        page ids are valid everywhere."""
        values = [sizing.num_pages, sizing.max_batch_tokens, sizing.max_requests_per_batch]
        num_pages, max_batch_tokens, max_requests = self.cpu.min_ints(values)
        max_pages = min(sizing.max_pages_per_request, num_pages)
        return Sizing(num_pages, sizing.page_size, max_batch_tokens, max_requests, max_pages)

    def agree_host_pages(self, num_pages: int) -> int:
        """CPU offload: every rank sizes its host tier from its own RAM; all use the smallest, so rank
        0's host page ids are valid everywhere (0 on any rank: offload off on every rank)."""
        (agreed,) = self.cpu.min_ints([num_pages])
        return agreed

    def fatal(self, error: BaseException) -> TensorParallelError:
        """A forward failed: the ranks cannot be known to agree any more, so the group is over."""
        if isinstance(error, TensorParallelError):
            return error
        return self.cpu.fail("running a step's forward", error)

    # -- driver ------------------------------------------------------------------------
    def publish(self, batch: StepPlan) -> None:
        """Send this step's decision (with everything that happened since the last message)."""
        message, self._pending = self._pending, StepMessage(Kind.STEP)
        message.released.extend(request.request_id for request in batch.released)
        message.copies = list(batch.copies)
        message.swaps = batch.swaps
        for entry in batch.entries:
            request = entry.request
            if request.request_id not in self._known:
                self._known.add(request.request_id)
                message.new.append(RequestSpec.of(request))
            pages = [(group.first_page, list(group.page_ids)) for group in request.pages]
            message.entries.append((request.request_id, entry.start, entry.num_tokens, pages))
        self.cpu.exchange(message)

    def record_tokens(self, sampling: list[Request], sampled: list[list[SampledToken]]) -> None:
        """`sampled[i]` holds the tokens `sampling[i]` got this step (one: no speculation here)."""
        for request, tokens in zip(sampling, sampled, strict=True):
            self._pending.tokens.extend((request.request_id, token) for token in tokens)

    def record_finished(self, requests: list[Request]) -> None:
        for request in requests:
            self._known.discard(request.request_id)
            self._pending.finals.append(
                (request.request_id, int(request.status), request.finish_reason, request.error)
            )

    def send(self, kind: Kind) -> None:
        """An IDLE / END / STOP message, flushing what happened since the last one."""
        message, self._pending = self._pending, StepMessage(Kind.STEP)
        message.kind = kind
        self.cpu.exchange(message)

    def try_stop(self) -> None:
        """Tell the followers the manager stopped; silent when the group is already broken."""
        if self.cpu.broken is None:
            try:
                self.send(Kind.STOP)
            except TensorParallelError:
                logger.exception("could not tell the other ranks that the manager stopped")

    # -- follower ----------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """A follower's own submission (`generate_batch` runs on every rank with the same inputs)."""
        self.requests[request.request_id] = request
        self.run_ended = False

    def receive(self) -> tuple[StepMessage, StepPlan, list[Request], list[Request]]:
        """Apply rank 0's next message to the mirror. Returns it, the batch to run (mirrors, with rank
        0's pages), the requests that ended and those that got a token and still run."""
        message = self.cpu.exchange()
        if not isinstance(message, StepMessage):  # rank 0 sends nothing else
            raise TensorParallelError(f"rank 0 sent a {type(message).__name__}, not a step message")
        progressed, finished = [], []
        for request_id, token in message.tokens:
            request = self.requests[request_id]
            request.append_token(token.token_id, token.logprob, token.top_logprobs)
            progressed.append(request)
        for request_id, status, reason, error in message.finals:
            ended = self.requests.pop(request_id, None)
            if ended is not None:
                # A mirror copies the driver's checked transitions, so it takes the final status as is.
                ended.status, ended.finish_reason, ended.error = RequestStatus(status), reason, error
                ended.finish_time = time.perf_counter()
                ended.pages = []
                finished.append(ended)
        for spec in message.new:
            self._mirror(spec)
        entries = []
        for request_id, start, num_tokens, pages in message.entries:
            request = self.requests[request_id]
            request.pages = [PageList(page_ids, first_page) for first_page, page_ids in pages]
            request.num_computed_tokens = start
            entries.append(ScheduledRequest(request, start, num_tokens))
        released = [self.requests[i] for i in message.released if i in self.requests]
        for request in released:
            request.pages = []
        batch = StepPlan(
            entries=entries,
            copies=message.copies,
            swaps=message.swaps,
            released=[*released, *finished],  # rows of requests ended since the last message too
        )
        if message.kind == Kind.END:
            self.run_ended = True
        elif message.kind == Kind.STOP:
            self.stopped = True
        done = {id(r) for r in finished}
        return message, batch, finished, [r for r in progressed if id(r) not in done]

    def _mirror(self, spec: RequestSpec) -> None:
        own = self.requests.get(spec.request_id)
        if own is None:
            self.requests[spec.request_id] = spec.build()
        elif RequestSpec.of(own) != spec:
            raise ValueError(
                f"tensor parallelism: rank {self.rank}'s request {spec.request_id!r} differs from rank 0's; "
                "call generate_batch with the same inputs and settings on every rank"
            )
