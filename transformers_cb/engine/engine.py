"""The engine: one object that owns the scheduler, the cache and the runner.

`generate_batch` and the background manager both drive the same `step()`; the
loop around it is theirs (blocking vs. threaded), the step is shared. An engine is
built by `build.py` (`build_engine`): every setting resolved once into a frozen
`EngineSettings` (settings.py), then the parts wired; the engine takes both and resolves nothing. A
tensor-parallel rank other than 0 is a `FollowerEngine` (follower.py); rank 0 tells
the others about each step through its `StepPublisher` (publisher.py).

The layers above (manager/, api/, serve/, ...) use the surface below (`build_request`,
`add`, `step`, `finish`, `warmup`, `snapshot`, the page counts, the processor stages, `rank`,
...) and read settings from the frozen `settings` (`engine.settings.sampling.generation_config`,
`engine.settings.cache.sharing`, ...); never the parts behind it.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Container, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING

import torch

from ..attention.selection import paged_backend
from ..memory.kept_heap import kept_heap
from ..requests import Request, RequestStatus
from ..runner.layer_ops.native_layers import native_layers
from ..runner.products.batch_invariant import batch_invariant_modules
from ..runner.products.packed_model import packed_linears
from ..runner.products.torchao_linear import torchao_linears
from ..scheduler.speculation.draft_source import Drafts
from ..scheduler.speculation.speculation_stats import SpeculationStats
from ..scheduler.weight_updates import UpdateMode
from .parts import EngineParts, StepResult
from .snapshot import EngineCounters, EngineSnapshot, snapshot_of
from .weights.adapter_registry import AdapterRegistry
from .weights.weight_watch import WeightWatch

if TYPE_CHECKING:
    from ..scheduler.step_plan import StepPlan
    from .settings import EngineSettings

logger = logging.getLogger(__name__)

WARMUP_PROMPT_TOKENS = 16
WARMUP_REQUEST_ID = "__warmup__"


class Engine:
    """Args:
    settings: every setting, resolved (`settings.resolve_settings`); read, never written.
    parts: the parts wired from it (`build.build_engine` builds both: use it to make an engine).
    """

    def __init__(self, settings: EngineSettings, parts: EngineParts) -> None:
        self.settings = settings
        self.parts = parts  # as built (`snapshot_of` reads them); each held by name below too
        self.model = parts.model
        self.pages = parts.pages
        self.scheduler = parts.scheduler
        self.cache = parts.cache
        self.packer = parts.packer
        self.runner = parts.runner
        self.sampling = parts.sampling
        self.offload = parts.offload
        self.publisher = parts.publisher
        self.drafter = parts.drafter
        # Speculative decoding: whether this engine can, and every request's defaults.
        self.speculation = parts.speculation
        # Validate one submission into a `Request` (submission.py).
        self.build_request = parts.build_request
        self.counters = EngineCounters()
        self.warmed_up = False
        self._auto_ids = itertools.count()
        # The weights' changes and what they end (weight_watch.py).
        self.weight_watch = WeightWatch(self.model, self.scheduler, self.build_request.adapters)

    # -- tensor parallelism: what the layers above ask ----------------------------------------
    @property
    def is_follower(self) -> bool:
        """A tensor-parallel rank other than 0 (a `FollowerEngine`): it replays rank 0's steps."""
        return False

    @property
    def rank(self) -> int:
        """This engine's tensor-parallel rank (0 without tensor parallelism)."""
        return 0

    def end_session(self) -> None:
        """The manager's session ended: under tensor parallelism rank 0 ends the followers' too."""
        self.publisher.session_ended()

    # -- requests ------------------------------------------------------------
    def new_request_id(self, taken: Container[str] = ()) -> str:
        while True:
            request_id = f"req_{next(self._auto_ids)}"
            if request_id not in taken:
                return request_id

    def admission_order(self, requests: list[Request]) -> list[Request]:
        """The order to queue `requests` in: by prompt when prefix sharing is on, so that prompts
        sharing a prefix run back to back and the later ones hit the pages of the first."""
        if not self.pages.sharing:
            return list(requests)
        return sorted(requests, key=lambda request: request.prompt_ids)

    def add(self, request: Request) -> None:
        """Queue `request` (its fork siblings with it)."""
        self.scheduler.add(request)

    def unfittable_reason(self, num_tokens: int) -> str | None:
        """Why a request of `num_tokens` KV tokens can never run in this engine's cache, or None."""
        return self.pages.unfittable_reason(num_tokens)

    def running_requests(self) -> list[Request]:
        """The requests running now (a copy: safe to finish them while iterating)."""
        return list(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Requests queued in the engine and not admitted yet."""
        return len(self.scheduler.waiting)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def finish(self, request: Request, status: RequestStatus, error: str | None = None) -> None:
        """End `request` (cancel, fail): the scheduler's single exit (its rows and shadow go with the next
        plan's `released`, as every ended request's)."""
        self.scheduler.finish(request, status, error)
        self.publisher.requests_finished([request])

    def heartbeat(self) -> None:
        """Called by an idle (or paused) manager loop: keeps tensor-parallel followers in step."""
        self.publisher.idle()

    # -- sampling: the logits-processing stages ---------------------------------------------
    def processor_stage_names(self) -> list[str]:
        """The names of the logits-processing stages requests attached now go through, in order."""
        return [stage.name for stage in self.sampling.stages]

    def clear_logits_processors(self) -> None:
        """Drop every logits-processing stage (transformers' `manager.logit_processor.clear()`): requests
        attached from now on see the raw logits."""
        self.sampling.clear_stages()
        self.runner.replace_stages(self.sampling.stages)

    # -- pages ------------------------------------------------------------------------------
    @property
    def num_total_pages(self) -> int:
        """Device KV pages of every group together."""
        return sum(pool.num_pages for pool in self.pages.pools)

    @property
    def num_used_pages(self) -> int:
        """Device KV pages held by requests now, every group together (cached, evictable ones are free)."""
        return sum(pool.num_used_pages for pool in self.pages.pools)

    # -- warmup -----------------------------------------------------------------------------
    def warmup(self, num_prompt_tokens: int = WARMUP_PROMPT_TOKENS) -> bool:
        """Run a throw-away request through a prefill and a decode step, so the first real request
        does not pay for first-call costs (kernel selection, allocator growth, lazy init).

        Nothing of it stays: its pages are freed and the counters reset. Only an idle engine warms up;
        returns whether it did. Call it with the paged backend active (see `attention.selection`).
        """
        ran = self._warmup(num_prompt_tokens)
        if not ran:
            self.publisher.run_ended()  # tensor-parallel followers wait in their warmup for its end
        return ran

    @property
    def warmup_captures(self) -> bool:
        """Whether a warm-up makes something the steps then reuse: CUDA graphs captured, forwards compiled.
        Otherwise it only moves first-call costs earlier, which a batch run pays once either way
        (`generate_batch` warms up only then, as transformers' `warmup=` means: pre-capture)."""
        options = self.settings.step_options
        compiling = options.compile_settings
        return any(options.cuda_graphs) or compiling.varlen is not None or compiling.decode is not None

    def _warmup(self, num_prompt_tokens: int) -> bool:
        if self.has_work():
            return False
        length = min(
            num_prompt_tokens,
            self.settings.sizing.max_batch_tokens,
            self.settings.shape.max_position_embeddings - 2,
        )
        length = max(1, length)
        request = Request(request_id=WARMUP_REQUEST_ID, prompt_ids=[0] * length, max_new_tokens=2)
        if self.unfittable_reason(request.max_total_tokens) is not None:
            return False
        # Greedy without processors (the request has no sampling state), so that warming up draws
        # nothing from any random generator the real requests use.
        try:
            with self.runner.plain_greedy_sampler():
                self.add(request)
                while self.has_work():
                    self.step()
        finally:
            self.reset_counters()
            self.pages.clear_prefix_cache()
        self.warmed_up = True
        return True

    # -- weight updates ----------------------------------------------------------------------
    @property
    def adapters(self) -> AdapterRegistry | None:
        """The model's PEFT adapters by name (docs/adapters.md)."""
        return self.build_request.adapters

    @property
    def weight_version(self) -> int:
        """The version of the model's weights: 0 at creation, one more at each change `check_weights` saw."""
        return self.scheduler.weight_version

    def check_weights(self, mode: UpdateMode = "keep", changed: bool = False) -> list[Request] | None:
        """Apply a change of the model's weights, if there was one (`changed`: the caller knows; else the
        weights' fingerprint differs from the last one seen): a new weight version, the requests in flight
        kept, recomputed or aborted by `mode` (weight_watch.py, `WeightWatch.check`). Returns the requests it
        ended (`abort`; already finished: give each its final result), or None when nothing changed. Call
        it between two steps."""
        ended = self.weight_watch.check(mode, changed)
        if ended:
            self.publisher.requests_finished(ended)
        return ended

    def adapter_refusal(self, request: Request) -> str | None:
        """Why `request`, which chose its adapter, cannot run after the last weight change, or None."""
        return self.weight_watch.adapter_refusal(request)

    def forget_prefix_pages(self) -> None:
        """Every page loses its prefix key, cached or in use, and the running requests' promises are
        withdrawn (a weight check that failed: no page computed so far is trusted for later hits)."""
        self.pages.weights_changed(self.weight_version, self.scheduler.running)

    def drop_stale_prefix_cache(self) -> bool:
        """Forget the prefix pages if the model's weights changed since they were computed (`check_weights`
        on an idle engine: a persistent `generate_batch` engine reused, an idle manager taking new
        requests). Returns whether they changed."""
        return self.check_weights() is not None

    def reset_counters(self) -> None:
        """Start the work counters (`counters`, `snapshot().counters`, `snapshot().speculation`) from zero."""
        self.counters = EngineCounters()
        self.scheduler.speculation = SpeculationStats()

    # -- the run session ---------------------------------------------------------------
    @contextmanager
    def session(self) -> Iterator[None]:
        """The model as this engine runs it, for one run (a `generate_batch` call, the manager's thread, a
        warm-up): its paged attention backend, its packed products, torchao's int8 Linears on the native
        product, its native layer ops, the draft model's backend, the state layers' split forwards
        (runner/states/state_layers.py), batch-invariant mode's fixed-shape products and activations
        (runner/products/batch_invariant.py), the host heap kept between steps on CPU (memory/kept_heap.py),
        inference mode; all restored on exit. Every caller that steps the
        engine enters it, and only it."""
        with (
            paged_backend(self.model, self.settings.step_options.attn_implementation),
            packed_linears(self.model, self.settings.step_options.packed_linear),
            torchao_linears(self.model, self.settings.step_options.torchao_linears),
            native_layers(self.model, self.settings.step_options.native_layers),
            self.assistant_session(),
            self.runner.session(),
            batch_invariant_modules(self.model, self.settings.step_options.batch_invariant),
            kept_heap(self.settings.step_options.keep_heap),
            torch.inference_mode(),
        ):
            yield

    # -- the draft model ----------------------------------------------------------------
    def assistant_session(self) -> AbstractContextManager[object]:
        """The draft model under its paged backend for a run (beside the model's `paged_backend`); a
        no-op without one. Steps outside it switch the assistant per step."""
        return self.drafter.executor.session() if self.drafter is not None else nullcontext()

    def _drafts(self) -> Drafts:
        """This step's drafts, as data: each draft source's for its running requests (none in a step
        where the scheduler does not speculate, `speculates_now`)."""
        drafts: Drafts = {}
        if self.scheduler.speculates_now():
            for source in self.speculation.sources:
                drafts.update(source.propose(self.scheduler.running))
        return drafts

    # -- one step ----------------------------------------------------------------
    def step(self) -> StepResult:
        """Schedule and run one forward pass. A failure fails only the requests of this step (under
        tensor parallelism it raises `TensorParallelError`: the ranks cannot be known to agree)."""
        batch = self.scheduler.schedule(self._drafts())
        try:
            return self._run(batch)
        finally:
            self.scheduler.plan_ran()

    def _run(self, batch: StepPlan) -> StepResult:
        """`step`'s second half: run the plan and apply its result."""
        self.publisher.step_planned(batch)
        result = StepResult(finished=list(batch.failed))
        if not batch.entries:
            self.runner.apply(batch)  # the plan alone: copies, swaps, released rows
            return self._ended(result)
        self._fail_bad_media(batch, result)
        if not batch.entries:
            self.runner.apply(batch)
            return self._ended(result)
        self.counters.steps += 1
        try:
            output = self.runner.run(batch)
        except Exception as error:  # noqa: BLE001 - recorded on every request of the step
            self.publisher.step_failed(error)  # raises under tensor parallelism
            logger.exception("continuous batching step failed; failing its %d requests", len(batch.entries))
            self.counters.failed_steps += 1
            message = f"step failed: {type(error).__name__}: {error}"
            for entry in batch.entries:
                self.finish(entry.request, RequestStatus.FAILED, message)
                result.finished.append(entry.request)
            return result
        for entry in batch.entries:
            if entry.draft or (entry.num_tokens == 1 and entry.request.generated_ids):
                self.counters.decode_tokens += entry.num_tokens  # a speculating request's draft tokens too
            else:
                self.counters.prefill_tokens += entry.num_tokens
        sampling = [entry.request for entry in batch.entries if entry.samples]
        # Tokens appended, not sampled: a verified run stops at the token that ends its request.
        generated = sum(request.num_tokens for request in sampling)
        finished = self.scheduler.update(
            batch, output.sampled, output.prompt_logprobs, output.prompt_top_logprobs
        )
        self.counters.generated_tokens += sum(request.num_tokens for request in sampling) - generated
        result.finished.extend(finished)
        result.progressed = [request for request in sampling if not request.is_finished]
        result.num_tokens = batch.num_tokens
        self.publisher.tokens_sampled(sampling, output.sampled)
        return self._ended(result)

    def _fail_bad_media(self, batch: StepPlan, result: StepResult) -> None:
        """Encode the media of the plan's newly admitted requests (none of which the same plan releases);
        a request whose media the encoder refuses fails alone, its entry leaving the step (runner/media/media_runner.py)."""
        failures = self.runner.encode_media(batch)
        if not failures:
            return
        for entry in batch.entries:
            reason = failures.get(entry.request.request_id)
            if reason is not None:
                self.finish(
                    entry.request, RequestStatus.FAILED, f"request {entry.request.request_id!r}: {reason}"
                )
                result.finished.append(entry.request)
        batch.entries = [entry for entry in batch.entries if entry.request.request_id not in failures]

    def _ended(self, result: StepResult) -> StepResult:
        """The step's outcome for the publisher (rank 0: the next message; the end of a drained run)."""
        self.publisher.step_ended(result.finished, self.scheduler.has_work)
        return result

    # -- observability ----------------------------------------------------------------
    def snapshot(self) -> EngineSnapshot:
        """Every count `manager.stats()` reports from the engine, in one object (copies, not views)."""
        return snapshot_of(self.settings, self.parts, self.counters)

    def check_integrity(self) -> None:
        """Pages, queues and block-table rows are consistent (raises `InvariantError`)."""
        self.scheduler.check_integrity()
        # Rollbacks and releases the next plan's rows execute.
        taken_back, ended = self.scheduler.taken_back, {r.request_id for r in self.scheduler.ended}
        for g, tables in enumerate(self.packer.block_tables):
            tables.check_integrity(
                self.scheduler.running,
                {item.request.request_id: item.end_pages[g] for item in taken_back},
                ended,
            )
        if self.drafter is not None:
            self.drafter.check_integrity()
