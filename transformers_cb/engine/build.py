"""Building an engine: every setting resolved once into a frozen `EnginePlan`, then the parts wired.

`build_engine(model, generation_config, cb_config, ...)` is how an engine is made. It runs in two
phases, so that what the engine uses is one object that can be read and tested:

1. `resolve_plan`: validate and resolve everything that depends on the model, the device, the configs
   and the workload (model support, the generation config, the KV groups and this rank's shard of the
   model's shape, the GPU-only options, sizing, step options, the pages and block-table width of every
   KV group, the host tier's pages). Under tensor parallelism the ranks agree on the sizes here (the
   smallest any rank can afford). Nothing is allocated; no config is written: the caller's
   `ContinuousBatchingConfig` is copied once, and that copy is only read.
2. `wire`: allocate and connect the parts from the plan alone: the page pools beside their page
   policies (kv/ owns pages), the KV tensors (memory/ owns bytes, told only the pages of each group),
   the host tier, the scheduler, the packer, the sampling setup and the runner; then an `Engine`, or on
   a tensor-parallel rank other than 0 a `FollowerEngine`.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel

from ..config.continuous_batching import (
    ContinuousBatchingConfig,
    DeviceOptions,
    resolve_device_options,
    resolve_speculation_max_batch,
)
from ..config.generation_fields import ResolvedConfig, resolve_generation_config
from ..distributed import TensorParallelCoordinator
from ..distributed.sharding import shard_shape, tp_size_of
from ..kv.layer_groups import KVGroupSpec, kv_groups_from_config
from ..kv.offload import CpuOffload
from ..kv.page_manager import PageManager
from ..kv.page_policies import make_page_policy, num_pages_for
from ..kv.pool import PagePool
from ..kv.state_slots import StateSlotPolicy
from ..memory.host_cache import HostKVCache, resolve_host_pages
from ..memory.kv_cache import CacheLayout, PagedKVCache
from ..memory.sizing import ModelShape, Sizing, resolve_group_pages, resolve_sizing
from ..memory.state_cache import StateCache
from ..memory.swap import SwapCopier
from ..runner.compile_plan import CompilePlan
from ..runner.model_runner import ModelRunner
from ..runner.packing import BatchPacker
from ..runner.state_layers import StateLayers
from ..runner.step_options import StepOptions, resolve_step_options
from ..sampling.neutral import check_generation_config
from ..sampling.request_state import SamplingSetup
from ..sampling.sampler import Sampler
from ..scheduler.policies import make_policy
from ..scheduler.scheduler import Scheduler
from .assistant import (
    AssistantPlan,
    assistant_kv_bytes_per_token,
    build_drafter,
    check_assistant,
    resolve_assistant,
)
from .engine import Engine, EngineParts
from .follower import FollowerEngine
from .model_support import check_model_supported, ignores_logits_to_keep, state_layout
from .publisher import StepPublisher, TensorParallelPublisher
from .speculation_support import speculation_refusal
from .state_probe import StateLayout

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EnginePlan:
    """Every setting of one engine, resolved once at start; the engine and its parts only read it.

    `config` is the `ContinuousBatchingConfig` as given (the engine's validated private copy, never
    written); every other field is a resolved value, which is what the engine uses."""

    config: ContinuousBatchingConfig
    generation_config: GenerationConfig  # the defaults of every request (a resolved copy)
    kv_groups: tuple[KVGroupSpec, ...]
    shape: ModelShape  # this rank's shard of the model's shape (its KV heads under tensor parallelism)
    device: torch.device
    dtype: torch.dtype
    device_options: DeviceOptions  # CUDA graphs and async batching as they apply on `device`
    sizing: Sizing  # agreed by every tensor-parallel rank
    step_options: StepOptions
    cache: CacheLayout  # the KV tensors: pages of each group (the sizes of the groups' page pools)
    group_widths: tuple[int, ...]  # block-table width of each group
    initial_pages: int | None  # block-table width allocated up front (the workload's longest request)
    num_host_pages: int  # the host tier's pages of every group (0: no CPU offload); agreed by every rank
    scheduler_type: str
    safety_margin: float
    sharing: bool  # prefix sharing (and forks sharing their prompt's pages)
    max_queue_size: int
    per_request_processors: bool
    return_logprobs: bool
    top_logprobs: int
    prompt_logprobs: bool
    seed: int | None
    # Every per-request processor stage built, neutral unless a request gives a value (the server's engine).
    all_request_stages: bool = False
    # The model's state layers and their states' shapes (None: none); `sizing.num_state_slots` slots.
    states: StateLayout | None = None
    # Why the engine cannot speculate (state layers, tensor parallelism; None: it can).
    speculation_refusal: str | None = None
    # The draft model's plan (None: no `assistant_model`; engine/assistant.py).
    assistant: AssistantPlan | None = None

    @property
    def group_pages(self) -> tuple[int, ...]:
        """Pages of each KV group."""
        return self.cache.pages


def private_config(cb_config: ContinuousBatchingConfig | None) -> ContinuousBatchingConfig:
    """The engine's own validated copy of `cb_config` (the caller may change theirs later)."""
    config = copy.deepcopy(cb_config) if cb_config is not None else ContinuousBatchingConfig()
    config.validate()
    return config


def resolve_plan(
    model: PreTrainedModel,
    generation_config: GenerationConfig | ResolvedConfig | None,
    cb_config: ContinuousBatchingConfig | None,
    workload: list[int] | None = None,
    all_request_stages: bool = False,
    assistant_model: PreTrainedModel | None = None,
) -> tuple[EnginePlan, TensorParallelCoordinator | None]:
    """The plan of an engine for `model`, and this rank's tensor-parallel coordinator (None without
    tensor parallelism), which the ranks agree on sizes through. Raises (`ValueError`,
    `NotImplementedError`) before anything is allocated for what cannot run."""
    config = private_config(cb_config)
    generation = resolve_generation_config(model, generation_config)
    check_generation_config(generation)
    check_model_supported(model)
    states = state_layout(model)
    refusal = speculation_refusal(model, states is not None)
    assistant_shape = None
    if assistant_model is not None:
        assistant_shape = check_assistant(model, assistant_model, refusal)
    kv_groups = tuple(kv_groups_from_config(model.config))
    # Under tensor parallelism each rank caches its shard of the KV heads (raises for a bad split).
    shape = shard_shape(model, ModelShape.from_config(model.config), tp_size_of(model))
    tp = TensorParallelCoordinator.for_model(model, config.cpu_group_timeout)
    first_param = next(model.parameters())
    device, dtype = first_param.device, first_param.dtype
    device_options = resolve_device_options(config, device.type)
    sizing = resolve_sizing(
        config,
        shape,
        device,
        dtype,
        workload,
        states.bytes_per_slot if states else 0,
        0
        if assistant_shape is None or assistant_model is None
        else assistant_kv_bytes_per_token(assistant_model, assistant_shape),
    )
    if tp is not None:
        sizing = tp.agree_sizing(sizing)
    has_sliding = any(spec.sliding_window is not None for spec in kv_groups)
    step_options = resolve_step_options(
        model,
        config,
        device_options,
        generation,
        device.type,
        has_sliding,
        sizing.page_size,
        workload,
        ignores_logits_to_keep(model),
    )
    if states is not None:
        step_options = _without_traced_steps(step_options)
    group_pages, group_widths = resolve_group_pages(sizing, list(kv_groups), config, workload)
    cache = CacheLayout(
        num_layers=shape.num_layers,
        groups=kv_groups,
        pages=tuple(group_pages),
        page_size=sizing.page_size,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        dtype=dtype,
        device=device,
        scratch_page=any(step_options.cuda_graphs),
    )
    # CPU offload: under tensor parallelism every rank holds as many host pages (the fewest any rank
    # can afford), so that rank 0's host page ids are valid everywhere.
    # A model with state layers swaps each preempted request's state slot with its pages; a model with no
    # KV group at all (pure state-space) holds no page to swap and recomputes.
    num_host_pages = resolve_host_pages(config, cache, workload) if kv_groups else 0
    if states is not None:
        _note_state_limits(config, has_pages=bool(kv_groups))
    if tp is not None:
        num_host_pages = tp.agree_host_pages(num_host_pages)
    plan = EnginePlan(
        config=config,
        generation_config=generation,
        kv_groups=kv_groups,
        shape=shape,
        device=device,
        dtype=dtype,
        device_options=device_options,
        sizing=sizing,
        step_options=step_options,
        cache=cache,
        group_widths=tuple(group_widths),
        initial_pages=num_pages_for(max(workload), sizing.page_size) if workload else None,
        num_host_pages=num_host_pages,
        scheduler_type=config.scheduler_type,
        safety_margin=config.resolved_safety_margin,
        sharing=config.allow_block_sharing and states is None,
        max_queue_size=config.max_queue_size,
        per_request_processors=config.per_request_processors,
        return_logprobs=config.return_logprobs,
        top_logprobs=config.top_logprobs,
        prompt_logprobs=config.prompt_logprobs,
        seed=config.seed,
        all_request_stages=all_request_stages,
        states=states,
        speculation_refusal=refusal,
        assistant=None
        if assistant_model is None or assistant_shape is None
        else resolve_assistant(
            assistant_model,
            assistant_shape,
            sizing,
            config,
            workload,
            step_options.attn_implementation if assistant_model is model else None,
        ),
    )
    return plan, tp


def wire(
    model: PreTrainedModel,
    plan: EnginePlan,
    tp: TensorParallelCoordinator | None = None,
    tokenizer: Any | None = None,
    logits_processor: Any | None = None,
    assistant_model: PreTrainedModel | None = None,
) -> Engine:
    """Allocate and connect the parts of an engine from `plan` (see the module docstring);
    `assistant_model`: the draft model `plan.assistant` was resolved for."""
    page_size = plan.sizing.page_size
    # kv/ owns pages: one pool per KV group, each handed to its group's page policy.
    pools = [PagePool(num_pages) for num_pages in plan.group_pages]
    policies = [
        make_page_policy(spec, pool, page_size, g)
        for g, (spec, pool) in enumerate(zip(plan.kv_groups, pools, strict=True))
    ]
    # A model with state layers: its per-request state slots are one more group behind the page manager.
    slots = StateSlotPolicy(plan.sizing.num_state_slots) if plan.states is not None else None
    pages = PageManager(
        policies, list(plan.kv_groups), sharing=plan.sharing, page_size=page_size, slots=slots
    )
    cache = PagedKVCache.from_layout(plan.cache)
    # CPU offload: the scheduler plans with the host tier's page ids (`offload`; state slots with as many
    # host slots as device ones: every running request may be swapped out with its slot), the runner
    # copies into its tensors (`swapper`). Each rank's runner replays rank 0's swaps on its own KV shard.
    offload, swapper = None, None
    if plan.num_host_pages:
        offload = CpuOffload(policies, plan.num_host_pages, slots)
        swapper = SwapCopier(cache.group_tensors, HostKVCache(cache, plan.num_host_pages).tensors)
    states = None
    if plan.states is not None:
        host_states = None
        if plan.num_host_pages:
            host_states = StateCache(
                plan.states.specs, plan.sizing.num_state_slots, torch.device("cpu"), empty=True
            )
        states = StateLayers(
            plan.states.modules,
            StateCache(plan.states.specs, plan.sizing.num_state_slots, plan.device),
            host=host_states,
            stepwise=plan.states.stepwise,
        )
    scheduler = Scheduler(
        pages,
        max_batch_tokens=plan.sizing.max_batch_tokens,
        max_requests_per_batch=plan.sizing.max_requests_per_batch,
        safety_margin=plan.safety_margin,
        policy=make_policy(plan.scheduler_type),
        offload=offload,
        speculation_max_batch=resolve_speculation_max_batch(plan.config, plan.device.type),
    )
    packer = BatchPacker(cache, list(plan.group_widths), plan.device, plan.initial_pages)
    packer.state_layers = states is not None
    sampling = SamplingSetup(
        plan.generation_config,
        plan.device,
        per_request_processors=plan.per_request_processors,
        return_logprobs=plan.return_logprobs,
        top_logprobs=plan.top_logprobs,
        prompt_logprobs=plan.prompt_logprobs,
        seed=plan.seed,
        tokenizer=tokenizer,
        user_processors=list(logits_processor or ()),
        vocab_size=plan.shape.vocab_size,
        all_request_stages=plan.all_request_stages,
    )
    sampler = Sampler(sampling.stages, sampling.do_sample, plan.device, sampling.grammars)
    runner = ModelRunner(model, packer, sampler, plan.step_options, swapper, states)
    parts = EngineParts(
        model=model,
        pages=pages,
        scheduler=scheduler,
        cache=cache,
        packer=packer,
        runner=runner,
        sampling=sampling,
        offload=offload,
        publisher=TensorParallelPublisher(tp) if tp is not None and tp.is_driver else StepPublisher(),
        drafter=None
        if plan.assistant is None or assistant_model is None
        else build_drafter(assistant_model, plan.assistant, plan.sizing.max_batch_tokens),
    )
    if tp is not None and not tp.is_driver:
        return FollowerEngine(plan, parts, tp)
    return Engine(plan, parts)


def _without_traced_steps(options: StepOptions) -> StepOptions:
    """A state model's step splits its state layers by request in Python (runner/state_layers.py), which
    neither `torch.compile` nor a CUDA graph captures: those steps run eagerly."""
    if options.compile_plan != CompilePlan() or any(options.cuda_graphs) or options.async_batching:
        logger.warning(
            "state layers: compiled steps, CUDA graphs and async batching are off for this model (its state "
            "layers run each request's rows at its own slot, eagerly)"
        )
    return dataclasses.replace(
        options, compile_plan=CompilePlan(), cuda_graphs=(False, False), async_batching=False
    )


def _note_state_limits(config: ContinuousBatchingConfig, has_pages: bool) -> None:
    """What a model with state layers does not use, said once (the state of a token cannot be looked up
    from a cached page: only recomputed)."""
    if config.allow_block_sharing:
        logger.info(
            "state layers: prefix sharing is off for this model (a cached prefix's pages do not hold the "
            "recurrent state after it); forks (num_return_sequences) copy the prompt's pages and state"
        )
    if config.cpu_offload_space and not has_pages:
        logger.info(
            "state layers: cpu_offload_space is not used for this model (it has no attention layer, so no "
            "page to swap): a preempted request recomputes its state"
        )


def build_engine(
    model: PreTrainedModel,
    generation_config: GenerationConfig | ResolvedConfig | None,
    cb_config: ContinuousBatchingConfig | None,
    tokenizer: Any | None = None,
    logits_processor: Any | None = None,
    workload: list[int] | None = None,
    all_request_stages: bool = False,
    assistant_model: PreTrainedModel | None = None,
) -> Engine:
    """An engine for `model`: the plan resolved (`resolve_plan`), then the parts wired (`wire`).

    Args:
        model: a transformers causal LM whose attention is (or will be switched to) a paged backend.
        generation_config: defaults of every request (the caller's object is copied, never mutated).
        cb_config: hardware-side settings (copied, never mutated; None: the defaults).
        tokenizer: needed only for stop strings and guided decoding.
        logits_processor: the caller's own processors, applied to each request's own history.
        workload: max KV length of each request known up front (sizes the cache on CPU); None if unknown.
        all_request_stages: build every per-request processor stage, neutral unless a request gives a
            value (the server's engine; see `SamplingSetup`).
        assistant_model: a draft model for speculative decoding (`generate()`'s name; engine/assistant.py):
            a small causal LM with the model's vocabulary, on its own paged cache.
    """
    plan, tp = resolve_plan(
        model, generation_config, cb_config, workload, all_request_stages, assistant_model
    )
    return wire(model, plan, tp, tokenizer, logits_processor, assistant_model)
