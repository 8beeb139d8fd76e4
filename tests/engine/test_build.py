"""engine/settings.py and engine/build.py: every setting resolved once into a frozen `EngineSettings` (nothing allocated, no config
written), then the parts wired from the settings alone; the values the engine runs with are the settings'."""

from __future__ import annotations

import copy
import dataclasses
from unittest import mock

import pytest
import torch
from transformers import GenerationConfig

from tests.support.engine import run_prompts
from tests.support.models import build_tiny_model, tiny_llama
from tests.support.prompts import prompts_of_lengths
from transformers_cb import ContinuousBatchingConfig
from transformers_cb.config.continuous_batching import DeviceOptions
from transformers_cb.engine.build import build_engine, wire
from transformers_cb.engine.engine import Engine
from transformers_cb.engine.settings import resolve_settings
from transformers_cb.kv.layer_groups import FULL_ATTENTION, KVGroupSpec
from transformers_cb.memory import host_cache
from transformers_cb.memory.kv_cache import CacheLayout, PagedKVCache

GREEDY = GenerationConfig(max_new_tokens=6, do_sample=False)


def _sliding_engine_config() -> ContinuousBatchingConfig:
    """Settings that resolution overrides on this CPU, sliding-window setup: graphs, async batching and
    the decode fast path all turn off; offload and the page counts are resolved from the work."""
    return ContinuousBatchingConfig(
        page_size=4,
        max_batch_tokens=16,
        use_cuda_graph=True,
        use_async_batching=True,
        max_blocks_per_request=32,
        cpu_offload_space=0.01,
    )


def test_the_callers_configs_are_untouched_after_the_engine_ran() -> None:
    model = build_tiny_model("qwen2_sliding")
    config, generation = _sliding_engine_config(), GenerationConfig(max_new_tokens=6, do_sample=False)
    config_before, generation_before = copy.deepcopy(config), generation.to_dict()
    engine = build_engine(model, generation, config, workload=[40] * 3)
    run_prompts(engine, model, prompts_of_lengths([30, 12, 21], seed=2))
    assert config == config_before and generation.to_dict() == generation_before
    # The engine's copy is the settings as given, never the resolved values.
    assert engine.settings.config == config_before and engine.settings.config is not config
    assert (
        engine.settings.config.use_cuda_graph is True and engine.settings.config.max_blocks_per_request == 32
    )
    assert engine.settings.device_options == DeviceOptions((False, False), False)
    assert (
        engine.settings.step_options.max_blocks_per_request == 0
        and engine.settings.step_options.cuda_graphs
        == (
            False,
            False,
        )
    )


def test_the_settings_are_frozen() -> None:
    engine = build_engine(tiny_llama(), GREEDY, ContinuousBatchingConfig(page_size=4, num_blocks=8))
    with pytest.raises(dataclasses.FrozenInstanceError):
        engine.settings.host.num_pages = 3  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        engine.settings.sizing.num_pages = 3  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        engine.settings.cache.layout.pages = (3,)  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        engine.settings.scheduler.safety_margin = 0.5  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        engine.settings.sampling.seed = 1  # type: ignore[misc]


def test_the_engine_runs_with_the_settings_values() -> None:
    model = build_tiny_model("qwen2_sliding")
    engine = build_engine(model, GREEDY, _sliding_engine_config(), workload=[40] * 3)
    settings = engine.settings
    full, sliding = settings.cache.group_pages
    assert sliding < full  # the sliding group is sized to its windows: resolution did something
    # Pages: the pools (beside the page policies), the KV tensors and the settings agree group by group.
    assert tuple(pool.num_pages for pool in engine.pages.pools) == settings.cache.group_pages
    assert (
        tuple(tensor.shape[2] for tensor in engine.cache.group_tensors) == settings.cache.group_pages
    )  # no scratch
    assert engine.cache.layout == settings.cache.layout and engine.num_total_pages == full + sliding
    assert (
        tuple(tables.max_pages_per_request for tables in engine.packer.block_tables)
        == settings.cache.group_widths
    )
    # Step budget, admission and the policy.
    scheduler = engine.scheduler
    assert (scheduler.max_batch_tokens, scheduler.max_requests_per_batch) == (
        16,
        settings.sizing.max_requests_per_batch,
    )
    assert (
        scheduler.safety_margin == settings.scheduler.safety_margin == 0.15
        and scheduler.policy.name == settings.scheduler.scheduler_type
    )
    assert engine.pages.sharing is settings.cache.sharing is True
    # The host tier, the runner's options, the sampling defaults.
    assert settings.host.num_pages > 0 and engine.offload.host.num_pages == settings.host.num_pages
    assert [t.shape[2] for t in engine.runner.swapper.host_tensors] == [settings.host.num_pages] * 2
    assert engine.runner.options is settings.step_options
    assert engine.sampling.config is settings.sampling.generation_config


def test_the_settings_are_resolved_before_anything_is_allocated() -> None:
    model = tiny_llama()
    config = ContinuousBatchingConfig(page_size=4, num_blocks=8, cpu_offload_space=0.01)
    with mock.patch.object(PagedKVCache, "__init__", side_effect=AssertionError("allocated")):
        settings, tp = resolve_settings(model, GREEDY, config)
    assert tp is None and settings.cache.group_pages == (8,) and settings.host.num_pages > 0
    engine = wire(model, settings)
    assert (
        type(engine) is Engine
        and engine.settings is settings
        and engine.cache.layout == settings.cache.layout
    )


def _layout(device: str) -> CacheLayout:
    group = KVGroupSpec(FULL_ATTENTION, (0, 1))
    return CacheLayout(2, (group,), (1000,), 16, 2, 8, torch.float32, torch.device(device))


def test_host_pages_count_a_cpu_device_cache_as_taken(monkeypatch) -> None:
    """Resolved before the device cache exists: on CPU, whose RAM both tiers share, the budget is what is
    left once that cache is allocated; a CUDA cache takes no RAM."""
    cpu, cuda = _layout("cpu"), _layout("cuda")
    assert cpu.page_bytes() == 2 * 2 * 16 * 2 * 8 * 4 and cpu.nbytes() == 1000 * cpu.page_bytes()
    available = 5000 * cpu.page_bytes()
    memory = mock.Mock(available=available)
    monkeypatch.setattr(host_cache.psutil, "virtual_memory", lambda: memory)
    config = ContinuousBatchingConfig(cpu_offload_space=None, cpu_offload_space_safety_threshold=0.5)
    assert host_cache.resolve_host_pages(config, cuda) == 2500
    assert host_cache.resolve_host_pages(config, cpu, workload=[10**6]) == 2000  # (5000 - 1000) / 2


def test_the_target_and_the_draft_model_wire_their_kv_one_way() -> None:
    """`wire_kv` builds both models' KV parts: each group's policy over its own pool, sized by the settings;
    the draft model's pages belong to its planner (no sharing), its drafter only runs forwards."""
    model, assistant = tiny_llama(), tiny_llama(num_hidden_layers=1)
    config = ContinuousBatchingConfig(page_size=4, num_blocks=16)
    engine = build_engine(model, GenerationConfig(max_new_tokens=4), config, assistant_model=assistant)
    drafter = engine.drafter
    assert drafter is not None and engine.settings.assistant is not None
    assert [pool.num_pages for pool in engine.pages.pools] == list(engine.settings.cache.group_pages)
    assert [pool.num_pages for pool in drafter.pages.pools] == list(engine.settings.assistant.cache.pages)
    assert [policy.pool for policy in drafter.pages.policies] == drafter.pages.pools
    assert engine.pages.sharing and not drafter.pages.sharing
    assert drafter.executor.packer.cache is not engine.cache
    assert not hasattr(drafter.executor, "pages")
