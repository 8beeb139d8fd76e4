"""Request state. Its status enum is status.py's, the `GenerationOutput` a user receives outputs.py's (both
importable from here too, their public path).

A request is phase-free: its progress is two counters. `num_computed_tokens`
counts tokens whose KV is in the cache; `all_token_ids` is prompt + generated.
The tokens still to run are `all_token_ids[num_computed_tokens:]`:

    |<------------- all_token_ids ------------->|
    |<-- num_computed_tokens -->|<- remaining ->|
    prefill: remaining = rest of the prompt (maybe split into chunks)
    decode:  remaining = 1 (the last sampled token)
    after preemption: num_computed_tokens = 0, remaining = everything

A step that runs the last remaining token produces the next token.

A request's outputs (`to_output`) share its growing lists instead of copying them (outputs.py).

A request carries the state its sampling and speculation rooms attach (`Request.sampling`,
`Request.speculation`); this module, below both, knows them only by what it calls on them
(`SamplingState`, `SpeculationCounts`: protocols), so it imports nothing above it, not even for types.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from .invariants import InvariantError
from .outputs import GenerationOutput, shared
from .status import ALLOWED_TRANSITIONS, FINISH_REASONS, RequestStatus

__all__ = [
    "ALLOWED_TRANSITIONS",
    "AdapterChoice",
    "FINISH_REASONS",
    "GenerationOutput",
    "Request",
    "RequestStatus",
]


class OutputOptions(Protocol):
    """What a request's outputs carry beyond its tokens (`sampling.params.SamplingParams`)."""

    @property
    def prompt_logprobs(self) -> bool: ...

    @property
    def top_logprobs(self) -> int: ...


class SamplingState(Protocol):
    """What a request asks of its sampling state (`sampling.request_state.RequestSampling`)."""

    @property
    def params(self) -> OutputOptions: ...

    def hits_stop_string(self, token_ids: list[int]) -> bool: ...

    def grammar_finished(self, generated_ids: list[int]) -> bool: ...


class DraftCounts(Protocol):
    """A request's speculation counts (`scheduler.speculation.speculation_stats.SpeculationStats`)."""

    @property
    def drafted(self) -> int: ...

    @property
    def accepted(self) -> int: ...


class SpeculationCounts(Protocol):
    """What a request asks of its speculation state (`scheduler.speculation.back_off.SpeculationState`): its
    counts, for the output."""

    @property
    def stats(self) -> DraftCounts: ...


class MediaSpans(Protocol):
    """Where a request's images / videos / audio sit in its prompt, as the torch-free rooms see them
    (`memory.media_store.RequestMedia`): the scheduler sizes the embedding store with it, prefix
    sharing salts the keys of the pages it covers."""

    @property
    def num_rows(self) -> int: ...

    @property
    def end(self) -> int: ...

    def page_salt(self, start: int, end: int) -> bytes: ...

    @property
    def blocks(self) -> tuple[tuple[int, int], ...]:
        """Prompt spans `[start, end)` whose tokens attend to each other both ways (Gemma 3's images): a
        prefill chunk never ends inside one (scheduler/media_budget.py)."""
        ...


@dataclass
class PageList:
    """A request's pages in one KV layer group: `page_ids[i]` holds logical page `first_page + i`,
    i.e. tokens `[(first_page + i) * page_size, (first_page + i + 1) * page_size)`.

    Full attention keeps every page (`first_page` stays 0); a sliding-window group drops the pages
    that fell out of its window, so `first_page` moves forward.
    """

    page_ids: list[int] = field(default_factory=list)
    first_page: int = 0

    @property
    def end_page(self) -> int:
        """One past the last logical page held."""
        return self.first_page + len(self.page_ids)


@dataclass(frozen=True)
class AdapterChoice:
    """The PEFT adapters a request runs with (docs/adapters.md): `names` applied in order (empty: the base
    model alone, no adapter at all), at the adapter weights' `version` (an in-place update of an adapter
    bumps it). Chosen at submission (`engine/weights/adapter_registry.py`); the runner groups a step's rows by it
    (runner/adapter_rows.py) and the prefix cache salts the request's page keys with it (`salt`)."""

    names: tuple[str, ...]
    version: int = 0

    def salt(self) -> bytes:
        """The page keys' salt: no page is shared across adapters, or across versions of one."""
        return b"adapter\x00" + "\x00".join(self.names).encode() + b"\x00" + str(self.version).encode()


@dataclass(eq=False)
class Request:
    """Scheduler-side state of one sequence. Only the engine mutates it."""

    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    streaming: bool = False
    record_timestamps: bool = False
    status: RequestStatus = RequestStatus.PENDING
    generated_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[float] | None = None  # logprobs of prompt tokens 1, 2, ... computed so far
    prompt_top_logprobs: list[dict[int, float]] | None = None  # their top_logprobs alternatives
    sampling: SamplingState | None = None  # None: plain greedy argmax (sampling/request_state.py)
    num_computed_tokens: int = 0
    pages: list[PageList] = field(default_factory=list)  # one per KV layer group, see `kv/layer_groups.py`
    num_preemptions: int = 0
    error: str | None = None
    finish_reason: str | None = None
    created_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    # Prefix sharing (kv/prefix_cache.py): content keys of the full pages so far, and how many
    # of the pages held are keyed in the pools.
    page_keys: list[bytes] = field(default_factory=list, repr=False)
    num_registered_pages: int = 0
    num_promised_pages: int = 0  # pages up to here are being computed: later requests wait for them
    # (page index, tokens) of the last page whose first tokens have partial keys (kv/prefix_cache.py)
    partial_keyed: tuple[int, int] = (-1, 0)
    # num_return_sequences: all siblings of this request (fixed), and those not forked yet (the
    # scheduler forks them once this request's prompt is computed).
    siblings: list[Request] = field(default_factory=list, repr=False)
    fork_children: list[Request] = field(default_factory=list, repr=False)
    fork_parent: Request | None = field(default=None, repr=False)
    num_output_tokens: int = 0  # generated tokens in this request's previous output (`to_output`)
    # Speculative decoding (prompt lookup): settings, draft length, counts; None: no speculation.
    speculation: SpeculationCounts | None = field(default=None, repr=False)
    # Images / videos / audio of the prompt (docs/multimodal.md); None: a text-only request.
    media: MediaSpans | None = field(default=None, repr=False)
    # Weight versions (docs/manager.md): the version the request's oldest KV was computed under (set when it
    # starts computing from nothing; None before), the most versions it may lag behind the current one
    # before its KV is recomputed (None: any), and `(index, version)` for each run of generated tokens one
    # version produced (`record_weight_version`).
    kv_version: int | None = None
    max_staleness: int | None = None
    weight_version_runs: list[tuple[int, int]] = field(default_factory=list, repr=False)
    # The adapters the request runs with (`AdapterChoice`); None: the model's own forwards, whatever adapter
    # it applies (a model without adapters, or one whose active adapter cannot be split per request).
    adapter: AdapterChoice | None = None

    def __post_init__(self) -> None:
        self.all_token_ids: list[int] = list(self.prompt_ids)
        self.timestamps: list[float] | None = [] if self.record_timestamps else None

    def group_pages(self, group: int) -> PageList:
        """The request's pages in KV layer group `group` (created empty on first use)."""
        while len(self.pages) <= group:
            self.pages.append(PageList())
        return self.pages[group]

    @property
    def family(self) -> list[Request]:
        """This request and the siblings it will fork (`num_return_sequences`), parent first."""
        return [self, *self.siblings]

    @property
    def holds_pages(self) -> bool:
        return any(pages.page_ids for pages in self.pages)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_remaining_tokens(self) -> int:
        """Tokens whose KV is not computed yet (what the next steps must run)."""
        return len(self.all_token_ids) - self.num_computed_tokens

    @property
    def max_total_tokens(self) -> int:
        """Upper bound of tokens whose KV this request can ever hold."""
        return self.num_prompt_tokens + self.max_new_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.sampling is not None and self.sampling.params.prompt_logprobs

    def set_status(self, status: RequestStatus) -> None:
        if status == self.status:
            return
        if status not in ALLOWED_TRANSITIONS[self.status]:
            raise InvariantError(f"{self.request_id}: {self.status.name} -> {status.name}")
        self.status = status

    def record_weight_version(self, version: int) -> None:
        """The tokens appended next are produced by weight version `version` (a new run if it changed)."""
        runs = self.weight_version_runs
        if not runs or runs[-1][1] != version:
            if runs and runs[-1][0] == len(self.generated_ids):  # an empty run: replaced
                runs.pop()
            runs.append((len(self.generated_ids), version))

    def add_prompt_logprobs(
        self,
        step_scored: Mapping[str, list[float]] | None,
        step_tops: Mapping[str, list[dict[int, float]]] | None = None,
    ) -> None:
        """The prompt-token logprobs (and best alternatives) a step scored for this request, of those it
        scored by request id, appended to this request's own."""
        scored = step_scored.get(self.request_id) if step_scored else None
        if not scored:
            return
        if self.prompt_logprobs is None:
            self.prompt_logprobs = []
        self.prompt_logprobs.extend(scored)
        tops = step_tops.get(self.request_id) if step_tops else None
        if tops:
            self.prompt_top_logprobs = [*(self.prompt_top_logprobs or ()), *tops]

    def append_token(
        self, token_id: int, logprob: float | None = None, top_logprobs: dict[int, float] | None = None
    ) -> None:
        now = time.perf_counter()
        if not self.generated_ids:
            self.first_token_time = now
        if self.timestamps is not None:
            self.timestamps.append(now)
        self.generated_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if logprob is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.append(logprob)
        if top_logprobs is not None:
            if self.top_logprobs is None:
                self.top_logprobs = []
            self.top_logprobs.append(top_logprobs)

    def stop_reason(self) -> str | None:
        """'stop' (eos, a stop string, the end of its guided grammar) or 'length' once the last token ends
        the request, else None."""
        if self.generated_ids and self.generated_ids[-1] in self.eos_token_ids:
            return "stop"
        if self.sampling is not None and self.sampling.hits_stop_string(self.all_token_ids):
            return "stop"
        if self.sampling is not None and self.sampling.grammar_finished(self.generated_ids):
            return "stop"
        if len(self.generated_ids) >= self.max_new_tokens:
            return "length"
        return None

    def _prompt_tops(self) -> list[dict[int, float] | None] | None:
        sampling = self.sampling
        if sampling is None or not sampling.params.prompt_logprobs or not sampling.params.top_logprobs:
            return None
        return shared(self.prompt_top_logprobs or (), head=(None,))

    def to_output(self) -> GenerationOutput:
        """The request's output now. Its lists are shared with the request, not copied (`SharedPrefix`):
        the request only appends to them. `new_tokens` are the tokens since the previous `to_output()`."""
        num_tokens = len(self.generated_ids)
        output = GenerationOutput(
            request_id=self.request_id,
            prompt_ids=shared(self.prompt_ids),
            generated_tokens=shared(self.generated_ids, num_tokens),
            status=self.status.user_visible,
            logprobs=None if self.logprobs is None else shared(self.logprobs),
            error=self.error,
            finish_reason=self.finish_reason,
            top_logprobs=None if self.top_logprobs is None else shared(self.top_logprobs),
            prompt_logprobs=shared(self.prompt_logprobs or (), head=(None,))
            if self.wants_prompt_logprobs
            else None,
            prompt_top_logprobs=self._prompt_tops(),
            created_time=self.created_time,
            first_token_time=self.first_token_time,
            finish_time=self.finish_time,
            timestamps=None if self.timestamps is None else shared(self.timestamps),
        )
        if self.weight_version_runs:
            runs = self.weight_version_runs
            last = len(runs) if runs[-1][0] < num_tokens else len(runs) - 1  # a run not begun yet: left out
            output.weight_version_runs = tuple(runs[:last])
        output.kv_weight_version = self.kv_version
        if self.speculation is not None:
            output.draft_tokens = self.speculation.stats.drafted
            output.accepted_draft_tokens = self.speculation.stats.accepted
        output.new_from, self.num_output_tokens = self.num_output_tokens, num_tokens
        return output
