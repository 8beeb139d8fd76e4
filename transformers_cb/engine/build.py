"""Building an engine: every setting resolved once into a frozen `EngineSettings`, then the parts wired.

`build_engine(model, generation_config, cb_config, ...)` is how an engine is made. It runs in two
phases, so that what the engine uses is one object that can be read and tested:

1. `settings.resolve_settings`: validate and resolve every setting into the `EngineSettings`
   (settings.py: one part's settings each, agreed across tensor-parallel ranks). Nothing is allocated;
   no config is written.
2. `wire`: allocate and connect the parts from the settings alone: the page pools beside their page
   policies (kv/ owns pages), the KV tensors (memory/ owns bytes, told only the pages of each group),
   the host tier, the scheduler, the packer, the sampling setup, the runner, the draft model, the
   engine's speculation and the request builder (submission.py); then an `Engine`, or on a
   tensor-parallel rank other than 0 a `FollowerEngine`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase
from transformers.generation.logits_process import LogitsProcessor

from ..config.continuous_batching import ContinuousBatchingConfig
from ..config.generation_fields import ResolvedConfig
from ..distributed import TensorParallelCoordinator
from ..kv.offload import CpuOffload
from ..kv.rope_rule import recomputes_at_switch_of, rope_rule_of
from ..kv.state_slots import StateSlotPolicy
from ..memory.host_cache import HostKVCache
from ..memory.sizing import query_heads_per_kv_head
from ..memory.state_cache import StateCache
from ..memory.swap import SwapCopier
from ..runner.media.media_runner import MediaRunner
from ..runner.model_runner import ModelRunner
from ..runner.states.state_layers import StateLayers
from ..sampling.request_state import SamplingSetup
from ..sampling.sampler import Sampler
from ..scheduler.media_budget import MediaBudget
from ..scheduler.scheduler import Scheduler
from .engine import Engine
from .follower import FollowerEngine
from .intake.media_inputs import MediaIntake
from .intake.submission import RequestBuilder
from .kv_wiring import KVParts, wire_kv
from .parts import EngineParts
from .publisher import StepPublisher, TensorParallelPublisher
from .settings import EngineSettings, resolve_settings
from .speculation.assistant import build_drafter
from .speculation.draft_setup import EngineSpeculation
from .weights.adapter_registry import AdapterRegistry


def _wire_states(settings: EngineSettings) -> StateLayers | None:
    """The state layers' tensors (and the host tier's copy with CPU offload) of a model with state layers."""
    if settings.states is None:
        return None
    host_states = None
    if settings.host.num_pages:
        host_states = StateCache(
            settings.states.specs, settings.sizing.num_state_slots, torch.device("cpu"), empty=True
        )
    return StateLayers(
        settings.states.modules,
        StateCache(settings.states.specs, settings.sizing.num_state_slots, settings.device),
        host=host_states,
        stepwise=settings.states.stepwise,
        calls=settings.states.calls,
    )


def _wire_sampling(
    settings: EngineSettings,
    tokenizer: PreTrainedTokenizerBase | None,
    logits_processor: Sequence[LogitsProcessor] | None,
) -> SamplingSetup:
    """Every request's sampling defaults and the processing stages, from the engine's sampling settings."""
    sampling_settings = settings.sampling
    return SamplingSetup(
        sampling_settings.generation_config,
        settings.device,
        per_request_processors=sampling_settings.per_request_processors,
        return_logprobs=sampling_settings.return_logprobs,
        top_logprobs=sampling_settings.top_logprobs,
        prompt_logprobs=sampling_settings.prompt_logprobs,
        seed=sampling_settings.seed,
        tokenizer=tokenizer,
        user_processors=list(logits_processor or ()),
        vocab_size=settings.shape.vocab_size,
        all_request_stages=sampling_settings.all_request_stages,
    )


def wire(
    model: PreTrainedModel,
    settings: EngineSettings,
    tp: TensorParallelCoordinator | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    logits_processor: Sequence[LogitsProcessor] | None = None,
    assistant_model: PreTrainedModel | None = None,
) -> Engine:
    """Allocate and connect the parts of an engine from `settings` (see the module docstring);
    `assistant_model`: the draft model `settings.assistant` was resolved for."""
    # A model with state layers: its per-request state slots are one more group behind the page manager.
    slots = StateSlotPolicy(settings.sizing.num_state_slots) if settings.states is not None else None
    # kv/ owns pages: one pool per KV group, each handed to its group's page policy (kv_wiring.py).
    kv = wire_kv(
        settings.cache.kv_groups,
        settings.cache.layout,
        settings.cache.group_widths,
        settings.device,
        settings.cache.sharing,
        settings.cache.initial_pages,
        slots,
        rope_rule_of(model.config, recomputes_at_switch_of(model)),
    )
    policies, pages, cache, packer = kv.policies, kv.pages, kv.cache, kv.packer
    if settings.step_options.batch_invariant:
        packer.every_chunk_native()
    else:
        packer.every_long_chunk_native(query_heads_per_kv_head(model.config))
    # CPU offload: the scheduler plans with the host tier's page ids (`offload`; state slots with as many
    # host slots as device ones: every running request may be swapped out with its slot), the runner
    # copies into its tensors (`swapper`). Each rank's runner replays rank 0's swaps on its own KV shard.
    offload, swapper = None, None
    if settings.host.num_pages:
        offload = CpuOffload(policies, settings.host.num_pages, slots)
        host = HostKVCache(cache, settings.host.num_pages)
        swapper = SwapCopier(cache.group_tensors, host.tensors, cache.scale_tensors, host.scales)
    states = _wire_states(settings)
    media_model = MediaIntake.of(model).on_backend(settings.step_options.attn_implementation)
    if tp is not None and media_model.takes_media and media_model.refusal is None:
        # Rank 0 encodes at admission; the other ranks replay plans, not the encoder's rows.
        media_model = dataclasses.replace(
            media_model, refusal="images, videos and audio do not run under tensor parallelism yet"
        )
    runs_media = media_model.takes_media and media_model.refusal is None
    media = _media_budget(model, settings, kv) if runs_media else None
    scheduler = Scheduler(
        pages,
        settings.scheduler,
        settings.sizing.max_batch_tokens,
        settings.sizing.max_requests_per_batch,
        offload=offload,
        media=media,
    )
    packer.state_layers = states is not None
    sampling_settings = settings.sampling
    sampling = _wire_sampling(settings, tokenizer, logits_processor)
    sampler = Sampler(sampling.stages, sampling.do_sample, settings.device, sampling.grammars)
    mrope = media_model.rope_index is not None
    media_runner = MediaRunner(model, mrope=mrope) if media is not None else None
    runner = ModelRunner(model, packer, sampler, settings.step_options, swapper, states, media_runner)
    drafter = (
        None
        if settings.assistant is None or assistant_model is None
        else build_drafter(assistant_model, settings.assistant, settings.sizing.max_batch_tokens)
    )
    # Speculative decoding: whether this engine can, and every request's defaults.
    speculation = EngineSpeculation.for_engine(
        settings.speculation_refusal,
        sampling_settings.generation_config,
        drafter.executor.model if drafter is not None else None,
        drafter,
    )
    parts = EngineParts(
        model=model,
        pages=pages,
        scheduler=scheduler,
        cache=cache,
        packer=packer,
        runner=runner,
        sampling=sampling,
        speculation=speculation,
        build_request=RequestBuilder(
            settings.shape,
            sampling_settings.generation_config,
            sampling,
            speculation,
            pages,
            media_model,
            media,
            AdapterRegistry(model),
        ),
        offload=offload,
        publisher=TensorParallelPublisher(tp) if tp is not None and tp.is_driver else StepPublisher(),
        drafter=drafter,
    )
    if tp is not None and not tp.is_driver:
        return FollowerEngine(settings, parts, tp)
    return Engine(settings, parts)


def _media_budget(model: PreTrainedModel, settings: EngineSettings, kv: KVParts) -> MediaBudget:
    """The embedding store's rows (docs/multimodal.md, "The store's size"): as many bytes as the device KV
    cache, at least as many rows as it holds tokens; with windowed groups only, whose pages do not bound a
    prompt, the model's context."""
    pages = kv.pages
    tokens = max(pool.num_pages for pool in pages.pools) * pages.page_size
    hidden = getattr(model.config.get_text_config(decoder=True), "hidden_size", None)
    row_bytes = hidden * model.dtype.itemsize if isinstance(hidden, int) and hidden > 0 else 0
    rows = max(tokens, kv.cache.nbytes() // row_bytes if row_bytes else 0)
    if all(policy.trims for policy in kv.policies):
        rows = max(rows, settings.shape.max_position_embeddings)
    return MediaBudget(rows, max_chunk=settings.sizing.max_batch_tokens)


def build_engine(
    model: PreTrainedModel,
    generation_config: GenerationConfig | ResolvedConfig | None,
    cb_config: ContinuousBatchingConfig | None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    logits_processor: Sequence[LogitsProcessor] | None = None,
    workload: list[int] | None = None,
    all_request_stages: bool = False,
    assistant_model: PreTrainedModel | None = None,
) -> Engine:
    """An engine for `model`: the settings resolved (`resolve_settings`), then the parts wired (`wire`).

    Args:
        model: a transformers causal LM whose attention is (or will be switched to) a paged backend.
        generation_config: defaults of every request (the caller's object is copied, never mutated).
        cb_config: hardware-side settings (copied, never mutated; None: the defaults).
        tokenizer: needed only for stop strings and guided decoding.
        logits_processor: the caller's own processors, applied to each request's own history.
        workload: max KV length of each request known up front (sizes the cache on CPU); None if unknown.
        all_request_stages: build every per-request processor stage, neutral unless a request gives a
            value (the server's engine; see `SamplingSetup`).
        assistant_model: a draft model for speculative decoding (`generate()`'s name; engine/speculation/assistant.py):
            a small causal LM with the model's vocabulary, on its own paged cache.
    """
    settings, tp = resolve_settings(
        model, generation_config, cb_config, workload, all_request_stages, assistant_model
    )
    return wire(model, settings, tp, tokenizer, logits_processor, assistant_model)
