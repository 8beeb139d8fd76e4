"""The engine: one object that owns the scheduler, the cache and the runner.

`generate_batch` and the background manager both drive the same `step()`; the
loop around it is theirs (blocking vs. threaded), the step is shared.
"""

from __future__ import annotations

import copy
import itertools
import logging
from dataclasses import dataclass, field, replace
from typing import Any

from transformers import GenerationConfig, PreTrainedModel

from ..config.continuous_batching import ContinuousBatchingConfig, resolve_device_options
from ..config.generation_fields import default_max_new_tokens, resolve_generation_config
from ..distributed import TensorParallelCoordinator
from ..distributed.coordinator import Kind
from ..distributed.sharding import shard_shape, tp_size_of
from ..kv.layer_groups import kv_groups_from_config
from ..kv.offload import CpuOffload
from ..kv.page_manager import PageManager
from ..kv.page_policies import make_allocator, num_pages_for
from ..memory.host_cache import HostKVCache, resolve_host_pages
from ..memory.kv_cache import PagedKVCache
from ..memory.sizing import ModelShape, Sizing, resolve_group_pages, resolve_sizing
from ..memory.swap import SwapCopier
from ..requests import Request, RequestStatus
from ..runner.model_runner import ModelRunner
from ..runner.packing import BatchPacker
from ..runner.step_options import resolve_step_options
from ..sampling.request_state import SamplingSetup
from ..sampling.sampler import Sampler, check_generation_config
from .forks import add_siblings, num_return_sequences_of
from .model_support import check_model_supported
from .policies import make_policy
from .scheduler import Scheduler
from .snapshot import EngineCounters, EngineSnapshot
from .submission import as_eos_token_ids, as_max_new_tokens, as_token_ids

logger = logging.getLogger(__name__)

WARMUP_PROMPT_TOKENS = 16
WARMUP_REQUEST_ID = "__warmup__"


@dataclass
class StepResult:
    finished: list[Request] = field(default_factory=list)  # ended this step (any final status)
    progressed: list[Request] = field(default_factory=list)  # got a new token this step, still running
    num_tokens: int = 0


class Engine:
    """Args:
    model: a transformers causal LM whose attention is (or will be switched to) a paged backend.
    generation_config: defaults of every request (the caller's object is copied, never mutated).
    cb_config: hardware-side settings.
    tokenizer: needed only for stop strings.
    logits_processor: the caller's own processors, applied to each request's own history.
    workload: max KV length of each request known up front (sizes the cache on CPU); None if unknown.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        generation_config: GenerationConfig | None,
        cb_config: ContinuousBatchingConfig | None,
        tokenizer: Any | None = None,
        logits_processor: Any | None = None,
        workload: list[int] | None = None,
    ) -> None:
        self.model = model
        self.cb_config = copy.deepcopy(cb_config) if cb_config is not None else ContinuousBatchingConfig()
        self.cb_config.validate()
        self.generation_config = resolve_generation_config(model, generation_config)
        check_generation_config(self.generation_config)
        check_model_supported(model)
        self.kv_groups = kv_groups_from_config(model.config)
        # Under tensor parallelism each rank caches its shard of the KV heads (raises for a bad split).
        self.shape = shard_shape(model, ModelShape.from_config(model.config), tp_size_of(model))
        self.tp = TensorParallelCoordinator.for_model(model, self.cb_config.cpu_group_timeout)
        first_param = next(model.parameters())
        self.device, self.dtype = first_param.device, first_param.dtype
        resolve_device_options(self.cb_config, self.device.type)
        self.sizing: Sizing = resolve_sizing(self.cb_config, self.shape, self.device, self.dtype, workload)
        if self.tp is not None:
            self.sizing = self.tp.agree_sizing(self.sizing)
        has_sliding = any(spec.sliding_window is not None for spec in self.kv_groups)
        self.step_options = resolve_step_options(
            model,
            self.cb_config,
            self.generation_config,
            self.device.type,
            has_sliding,
            self.sizing.page_size,
            workload,
        )
        self.cb_config.max_blocks_per_request = self.step_options.max_blocks_per_request
        group_pages, group_widths = resolve_group_pages(self.sizing, self.kv_groups, self.cb_config, workload)
        self.cache = PagedKVCache(
            num_layers=self.shape.num_layers,
            num_pages=group_pages,
            page_size=self.sizing.page_size,
            num_kv_heads=self.shape.num_kv_heads,
            head_dim=self.shape.head_dim,
            dtype=self.dtype,
            device=self.device,
            groups=self.kv_groups,
            scratch_page=any(self.step_options.cuda_graphs),
        )
        allocator = PageManager(
            [
                make_allocator(spec, pool, self.sizing.page_size, g)
                for g, (spec, pool) in enumerate(zip(self.kv_groups, self.cache.pools, strict=True))
            ],
            self.kv_groups,
            sharing=self.cb_config.allow_block_sharing,
        )
        # CPU offload: a host tier that preempted requests swap out to (None when off). The scheduler
        # plans with its page ids (`offload`), the runner copies into its tensors (`swapper`).
        # Under tensor parallelism every rank holds as many host pages (the fewest any rank can afford)
        # and its runner replays rank 0's swaps on its own KV shard.
        num_host_pages = resolve_host_pages(self.cb_config, self.cache, workload)
        if self.tp is not None:
            num_host_pages = self.tp.agree_host_pages(num_host_pages)
        self.offload: CpuOffload | None = None
        swapper = None
        if num_host_pages:
            self.offload = CpuOffload(allocator.allocators, num_host_pages)
            swapper = SwapCopier(self.cache.group_tensors, HostKVCache(self.cache, num_host_pages).tensors)
        self.scheduler = Scheduler(
            allocator,
            max_batch_tokens=self.sizing.max_batch_tokens,
            max_requests_per_batch=self.sizing.max_requests_per_batch,
            safety_margin=self.cb_config.resolved_safety_margin,
            policy=make_policy(self.cb_config.scheduler_type),
            offload=self.offload,
        )
        initial_pages = num_pages_for(max(workload), self.sizing.page_size) if workload else None
        self.packer = BatchPacker(self.cache, group_widths, self.device, initial_pages)
        self.sampling = SamplingSetup(
            self.generation_config,
            self.device,
            per_request_processors=self.cb_config.per_request_processors,
            return_logprobs=self.cb_config.return_logprobs,
            top_logprobs=self.cb_config.top_logprobs,
            prompt_logprobs=self.cb_config.prompt_logprobs,
            seed=self.cb_config.seed,
            tokenizer=tokenizer,
            user_processors=list(logits_processor or ()),
            vocab_size=self.shape.vocab_size,
        )
        sampler = Sampler(self.sampling.stages, self.sampling.do_sample, self.device, self.sampling.grammars)
        self.runner = ModelRunner(model, self.packer, sampler, self.step_options, swapper)
        self.counters = EngineCounters()
        self.warmed_up = False
        self._auto_ids = itertools.count()

    # -- requests ------------------------------------------------------------
    def default_max_new_tokens(self, num_prompt_tokens: int) -> int | None:
        return default_max_new_tokens(self.generation_config, num_prompt_tokens)

    def new_request_id(self, taken: Any = ()) -> str:
        while True:
            request_id = f"req_{next(self._auto_ids)}"
            if request_id not in taken:
                return request_id

    def build_request(
        self,
        input_ids: Any,
        request_id: str,
        max_new_tokens: int | None = None,
        eos_token_id: int | list[int] | None = None,
        streaming: bool = False,
        label: str | None = None,
        record_timestamps: bool = False,
        sampling_kwargs: dict[str, Any] | None = None,
        num_return_sequences: int | None = None,
    ) -> Request:
        """Validate one submission into a `Request`. Raises `ValueError` naming `label` on bad input.

        `sampling_kwargs`: per-request parameters (`temperature`, `top_k`, `seed`, `stop_strings`,
        `top_logprobs`, ...; see sampling_params.py), None values meaning "not given".
        `num_return_sequences` (default: the generation config's): with n > 1 the request carries
        n - 1 siblings (`siblings`, forked from `fork_children`), ids `f"{request_id}__child#{i}"`; `request.family` lists all."""
        label = label or f"request {request_id!r}"
        prompt = as_token_ids(input_ids, label, self.shape.vocab_size)
        if max_new_tokens is None:
            max_new_tokens = self.default_max_new_tokens(len(prompt))
            if max_new_tokens is None:
                raise ValueError(
                    f"{label}: no max_new_tokens given and the generation config has no max_length"
                )
        max_new_tokens = as_max_new_tokens(max_new_tokens, label)
        total = len(prompt) + max_new_tokens
        if total > self.shape.max_position_embeddings:
            raise ValueError(
                f"{label}: prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) = {total} exceeds "
                f"the model's max_position_embeddings ({self.shape.max_position_embeddings})"
            )
        if eos_token_id is None:
            eos_token_id = self.generation_config.eos_token_id
        request = Request(
            request_id=request_id,
            prompt_ids=prompt,
            max_new_tokens=max_new_tokens,
            eos_token_ids=as_eos_token_ids(eos_token_id, label),
            streaming=streaming,
            record_timestamps=record_timestamps,
        )
        self.sampling.attach(request, sampling_kwargs, label)
        reason = self.unfittable_reason(request.max_total_tokens)
        if reason is not None:
            raise ValueError(f"{label}: {reason}; raise num_blocks or lower max_new_tokens")
        count = num_return_sequences_of(num_return_sequences, self.generation_config, label)
        add_siblings(request, count, self.sampling, sampling_kwargs, label)
        return request

    def admission_order(self, requests: list[Request]) -> list[Request]:
        """The order to queue `requests` in: by prompt when prefix sharing is on, so that prompts
        sharing a prefix run back to back and the later ones hit the pages of the first."""
        if not self.scheduler.allocator.sharing:
            return list(requests)
        return sorted(requests, key=lambda request: request.prompt_ids)

    @property
    def is_follower(self) -> bool:
        """A tensor-parallel rank other than 0: it replays rank 0's steps and decides nothing."""
        return self.tp is not None and not self.tp.is_driver

    def add(self, request: Request) -> None:
        """Queue `request` (its fork siblings with it)."""
        if self.is_follower:
            for member in request.family:
                self.tp.add(member)
        else:
            self.scheduler.add(request)

    def clear_logits_processors(self) -> None:
        """Drop every logits-processing stage (transformers' `manager.logit_processor.clear()`): requests
        attached from now on see the raw logits."""
        self.sampling.clear_stages()
        self.runner.sampler = Sampler([], self.sampling.do_sample, self.device, self.sampling.grammars)

    def unfittable_reason(self, num_tokens: int) -> str | None:
        """Why a request of `num_tokens` KV tokens can never run in this engine's cache, or None."""
        return self.scheduler.allocator.unfittable_reason(num_tokens)

    def running_requests(self) -> list[Request]:
        """The requests running now (a copy: safe to finish them while iterating)."""
        return list(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Requests queued in the engine and not admitted yet."""
        return len(self.scheduler.waiting)

    def has_work(self) -> bool:
        if self.is_follower:
            return not self.tp.run_ended  # until rank 0 says its run drained
        return self.scheduler.has_work()

    def finish(self, request: Request, status: RequestStatus, error: str | None = None) -> None:
        """End `request` (cancel, fail): the scheduler's single exit, and its block-table rows back."""
        self.scheduler.finish(request, status, error)
        self.runner.release([request])
        if self.tp is not None and self.tp.is_driver:
            self.tp.record_finished([request])

    def heartbeat(self) -> None:
        """Called by an idle (or paused) manager loop: keeps tensor-parallel followers in step."""
        if self.tp is not None and self.tp.is_driver:
            self.tp.send(Kind.IDLE)

    def warmup(self, num_prompt_tokens: int = WARMUP_PROMPT_TOKENS) -> bool:
        """Run a throw-away request through a prefill and a decode step, so the first real request
        does not pay for first-call costs (kernel selection, allocator growth, lazy init).

        Nothing of it stays: its pages are freed and the counters reset. Only an idle engine warms up;
        returns whether it did. Call it with the paged backend active (see `attention.selection`).
        """
        if self.is_follower:
            return self._follow_warmup()
        ran = self._warmup(num_prompt_tokens)
        if self.tp is not None and not ran:
            self.tp.send(Kind.END)  # the followers wait in their warmup for rank 0's end of run
        return ran

    def _warmup(self, num_prompt_tokens: int) -> bool:
        if self.has_work():
            return False
        length = min(num_prompt_tokens, self.sizing.max_batch_tokens, self.shape.max_position_embeddings - 2)
        length = max(1, length)
        request = Request(request_id=WARMUP_REQUEST_ID, prompt_ids=[0] * length, max_new_tokens=2)
        if self.unfittable_reason(request.max_total_tokens) is not None:
            return False
        # Greedy without processors (the request has no sampling state), so that warming up draws
        # nothing from any random generator the real requests use.
        sampler, self.runner.sampler = self.runner.sampler, Sampler([], False, self.device)
        try:
            self.add(request)
            while self.has_work():
                self.step()
        finally:
            self.runner.sampler = sampler
            self.counters = EngineCounters()
            self.scheduler.allocator.clear_prefix_cache()
        self.warmed_up = True
        return True

    # -- one step ----------------------------------------------------------------
    def step(self) -> StepResult:
        """Schedule and run one forward pass. A failure fails only the requests of this step (under
        tensor parallelism it raises `TensorParallelError`: the ranks cannot be known to agree)."""
        if self.is_follower:
            return self._follow()
        batch = self.scheduler.schedule()
        if self.tp is not None:
            self.tp.publish(batch)
        result = StepResult(finished=list(batch.failed))
        if not batch.entries:
            self.runner.apply(batch)  # the plan alone: copies, swaps, released rows
            return self._published(result)
        self.counters.steps += 1
        try:
            output = self.runner.run(batch)
        except Exception as error:  # noqa: BLE001 - recorded on every request of the step
            if self.tp is not None:
                raise self.tp.fatal(error) from error
            logger.exception("continuous batching step failed; failing its %d requests", len(batch.entries))
            self.counters.failed_steps += 1
            message = f"step failed: {type(error).__name__}: {error}"
            for entry in batch.entries:
                self.finish(entry.request, RequestStatus.FAILED, message)
                result.finished.append(entry.request)
            return result
        for entry in batch.entries:
            if entry.num_tokens == 1 and entry.request.generated_ids:
                self.counters.decode_tokens += 1
            else:
                self.counters.prefill_tokens += entry.num_tokens
        sampling = [entry.request for entry in batch.entries if entry.samples]
        finished = self.scheduler.update(
            batch, output.sampled, output.prompt_logprobs, output.prompt_top_logprobs
        )
        self.runner.release(finished)
        self.counters.generated_tokens += len(output.sampled)
        result.finished.extend(finished)
        result.progressed = [request for request in sampling if not request.is_finished]
        result.num_tokens = batch.num_tokens
        if self.tp is not None:
            self.tp.record_tokens(sampling, output.sampled)
        return self._published(result)

    # -- tensor parallelism (see distributed/coordinator.py) -----------------------
    def _published(self, result: StepResult) -> StepResult:
        """Rank 0: queue this step's outcome for the next message; end the run when drained."""
        if self.tp is not None:
            self.tp.record_finished(result.finished)
            if not self.scheduler.has_work():
                self.tp.send(Kind.END)
        return result

    def _follow(self) -> StepResult:
        """A follower's step: apply rank 0's next message and run the same forward."""
        message, batch, finished, progressed = self.tp.receive()
        self.counters.steps += bool(batch.entries)
        try:
            self.runner.forward(batch)  # rank 0's plan (copies, swaps, released rows), then its forward
        except Exception as error:
            raise self.tp.fatal(error) from error
        self.counters.generated_tokens += len(message.tokens)
        return StepResult(finished=finished, progressed=progressed, num_tokens=batch.num_tokens)

    def _follow_warmup(self) -> bool:
        """Replay rank 0's warmup until its end of run."""
        self.tp.run_ended = False
        steps = self.counters.steps
        while not self.tp.run_ended:
            self.step()
        self.warmed_up = self.counters.steps > steps
        self.counters = EngineCounters()
        return self.warmed_up

    def snapshot(self) -> EngineSnapshot:
        """Every count `manager.stats()` reports from the engine, in one object (copies, not views)."""
        scheduler, allocator, offload = self.scheduler, self.scheduler.allocator, self.offload
        return EngineSnapshot(
            running=len(scheduler.running),
            waiting=len(scheduler.waiting),
            preemptions=scheduler.num_preemptions,
            pages_in_use=self.cache.num_used_pages,
            pages_total=self.cache.num_total_pages,
            pages_in_use_by_group=allocator.pages_in_use(),
            prefix=replace(allocator.prefix_stats),
            prefix_cache_pages=allocator.num_cached_pages,
            prefix_cache_evictions=allocator.num_evictions,
            recomputed_tokens=scheduler.recomputed.total,
            swapped_out=offload.num_swapped_out if offload is not None else 0,
            swap_out_pages=offload.swap_out_pages if offload is not None else 0,
            swap_in_pages=offload.swap_in_pages if offload is not None else 0,
            compiled_graphs=self.runner.forwards.graphs_compiled,
            counters=replace(self.counters),
        )

    def check_integrity(self) -> None:
        """Pages, queues and block-table rows are consistent (raises `InvariantError`)."""
        self.scheduler.check_integrity()
        for tables in self.packer.block_tables:
            tables.check_integrity(self.scheduler.running)
