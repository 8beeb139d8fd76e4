"""`EngineSettings`: every setting of one engine, resolved once at start (`resolve_settings`), then only read.

The settings are composed of one frozen settings object per part, each resolved by the room that owns the
setting (as vLLM's `VllmConfig` composes its configs): the device cache (`CacheSettings`, memory/cache_settings.py), the
host tier (`HostSettings`, memory/host_cache.py), the scheduler (`SchedulerSettings`,
scheduler/scheduler_settings.py), sampling (`SamplingSettings`, sampling/sampling_settings.py), the runner's step
(`StepOptions`, runner/step_options.py) and the draft model (`AssistantModelSettings`, engine/speculation/assistant.py).
What the parts share stays at the top: this rank's shard of the model's shape, the device, the agreed
`Sizing`, the state layers. `build.py` wires the parts from the settings alone; callers read settings from
`engine.settings`.

`resolve_settings` validates and resolves everything that depends on the model, the device, the configs and
the workload, in one order (the errors a bad input meets first stay the same): the generation config,
model support (model_check/), the speculation refusal and the draft model, the KV groups and this
rank's shard of the shape, the GPU-only options, sizing, step options, the cache, the host tier. Under
tensor parallelism the ranks agree on the sizes and the host tier here (the smallest any rank can
afford). Nothing is allocated; no config is written: the caller's `ContinuousBatchingConfig` is copied
once, and that copy is only read.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, PreTrainedModel

from ..config.continuous_batching import (
    ContinuousBatchingConfig,
    DeviceOptions,
    resolve_device_options,
    resolve_speculation_max_batch,
)
from ..config.generation_fields import ResolvedConfig
from ..distributed import TensorParallelCoordinator
from ..distributed.sharding import shard_shape, tp_size_of
from ..kv.layer_groups import KVGroupSpec, kv_groups_from_config
from ..memory.cache_settings import CacheSettings, resolve_cache_settings
from ..memory.host_cache import HostSettings, resolve_host_pages
from ..memory.kv_quant import INT8, int8_cache_problem, storage_dtype
from ..memory.sizing import ModelShape, Sizing, resolve_sizing
from ..model_check.model_support import (
    check_model_supported,
    ignores_logits_to_keep,
    observed_layers_of,
    state_layout,
)
from ..model_check.state_probe import StateLayout
from ..runner.step_options import StepOptions, resolve_step_options, without_traced_steps
from ..sampling.sampling_settings import SamplingSettings, resolve_sampling_settings
from ..scheduler.scheduler_settings import SchedulerSettings, resolve_scheduler_settings
from .speculation.assistant import (
    AssistantModelSettings,
    assistant_kv_bytes_per_token,
    check_assistant,
    resolve_assistant,
)
from .speculation.draft_setup import speculation_refusal
from .weights.pending_decompression import decompress_pending

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineSettings:
    """Every setting of one engine, resolved once at start; the engine and its parts only read it.

    `config` is the `ContinuousBatchingConfig` as given (the engine's validated private copy, never
    written); every other field is a resolved value, which is what the engine uses."""

    config: ContinuousBatchingConfig
    shape: ModelShape  # this rank's shard of the model's shape (its KV heads under tensor parallelism)
    device: torch.device
    dtype: torch.dtype
    device_options: DeviceOptions  # CUDA graphs and async batching as they apply on `device`
    sizing: Sizing  # agreed by every tensor-parallel rank
    step_options: StepOptions  # the runner's
    cache: CacheSettings  # the device KV cache
    host: HostSettings  # the host tier (CPU offload); agreed by every rank
    scheduler: SchedulerSettings
    sampling: SamplingSettings
    # The model's state layers and their states' shapes (None: none); `sizing.num_state_slots` slots.
    states: StateLayout | None = None
    # Why the engine cannot speculate (state layers, tensor parallelism; None: it can).
    speculation_refusal: str | None = None
    # The draft model's settings (None: no `assistant_model`; engine/speculation/assistant.py).
    assistant: AssistantModelSettings | None = None


def private_config(cb_config: ContinuousBatchingConfig | None) -> ContinuousBatchingConfig:
    """The engine's own validated copy of `cb_config` (the caller may change theirs later)."""
    config = copy.deepcopy(cb_config) if cb_config is not None else ContinuousBatchingConfig()
    config.validate()
    return config


def resolve_settings(
    model: PreTrainedModel,
    generation_config: GenerationConfig | ResolvedConfig | None,
    cb_config: ContinuousBatchingConfig | None,
    workload: list[int] | None = None,
    all_request_stages: bool = False,
    assistant_model: PreTrainedModel | None = None,
) -> tuple[EngineSettings, TensorParallelCoordinator | None]:
    """The settings of an engine for `model`, and this rank's tensor-parallel coordinator (None without
    tensor parallelism), which the ranks agree on sizes through. Raises (`ValueError`,
    `NotImplementedError`) before anything is allocated for what cannot run."""
    config = private_config(cb_config)
    sampling = resolve_sampling_settings(model, generation_config, config, all_request_stages)
    decompress_pending(model)  # a compressed-tensors checkpoint's first-forward hook: the engine bypasses it
    check_model_supported(model)
    states = state_layout(model)
    refusal = speculation_refusal(model, states is not None)
    assistant_shape = None
    if assistant_model is not None:
        assistant_shape = check_assistant(model, assistant_model, refusal)
    # The groups and shape the model's forward attends with (model_check: the probe), where it differs
    # from its config.
    observed = observed_layers_of(model)
    kv_groups = tuple(kv_groups_from_config(model.config, observed))
    # Under tensor parallelism each rank caches its shard of the KV heads (raises for a bad split).
    shape = shard_shape(model, ModelShape.from_config(model.config, observed), tp_size_of(model))
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
    if states is not None:
        sizing = _within_state_step_limit(sizing, config, states)
    if tp is not None:
        sizing = tp.agree_sizing(sizing)
    # Sliding and chunked groups recycle pages (what the decode fast path's tables cannot follow).
    has_sliding = any(spec.span is not None for spec in kv_groups)
    step_options = resolve_step_options(
        model,
        config,
        device_options,
        sampling.generation_config,
        device.type,
        has_sliding,
        sizing.page_size,
        workload,
        ignores_logits_to_keep(model),
    )
    if states is not None:
        step_options = without_traced_steps(step_options)
    _check_kv_cache_dtype(config, kv_groups, step_options.attn_implementation)
    cache = resolve_cache_settings(
        sizing,
        kv_groups,
        shape,
        config,
        workload,
        storage_dtype(config.kv_cache_dtype, dtype),
        device,
        scratch_page=any(step_options.cuda_graphs),
        sharing=config.allow_block_sharing and states is None,
    )
    # CPU offload: under tensor parallelism every rank holds as many host pages (the fewest any rank
    # can afford), so that rank 0's host page ids are valid everywhere.
    # A model with state layers swaps each preempted request's state slot with its pages; a model with no
    # KV group at all (pure state-space) holds no page to swap and recomputes.
    num_host_pages = resolve_host_pages(config, cache.layout, workload) if kv_groups else 0
    if states is not None:
        _note_state_limits(config, has_pages=bool(kv_groups))
    if tp is not None:
        num_host_pages = tp.agree_host_pages(num_host_pages)
    settings = EngineSettings(
        config=config,
        shape=shape,
        device=device,
        dtype=dtype,
        device_options=device_options,
        sizing=sizing,
        step_options=step_options,
        cache=cache,
        host=HostSettings(num_pages=num_host_pages),
        scheduler=resolve_scheduler_settings(config, resolve_speculation_max_batch(config, device.type)),
        sampling=sampling,
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
    return settings, tp


def _check_kv_cache_dtype(
    config: ContinuousBatchingConfig, kv_groups: tuple[KVGroupSpec, ...], attn_implementation: str
) -> None:
    """Refuse an int8 KV cache where its pages cannot be read (memory/kv_quant.py), before allocating."""
    if config.kv_cache_dtype != INT8:
        return
    problem = int8_cache_problem(kv_groups, attn_implementation)
    if problem is not None:
        raise ValueError(f"ContinuousBatchingConfig.kv_cache_dtype='int8' does not support {problem}")


def _within_state_step_limit(sizing: Sizing, config: ContinuousBatchingConfig, states: StateLayout) -> Sizing:
    """`sizing` with a step no longer than the state layers take whole (`StateLayout.max_step_tokens`:
    xLSTM splits a longer forward itself, which the per-request split cannot follow): the default
    budget lowered to it, a `max_batch_tokens` asked above it refused."""
    limit = states.max_step_tokens
    if limit is None or sizing.max_batch_tokens <= limit:
        return sizing
    if config.max_batch_tokens is not None:
        raise ValueError(
            f"max_batch_tokens={config.max_batch_tokens} exceeds the {limit} tokens this model's state "
            "layers run in one forward (its max_inference_chunksize): set max_batch_tokens to at most that"
        )
    return dataclasses.replace(sizing, max_batch_tokens=limit)


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
