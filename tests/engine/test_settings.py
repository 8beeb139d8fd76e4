"""engine/settings.py: the `EngineSettings` composed of one frozen settings object per part, each resolved by its room, and
the parts wired from it (the request builder among them, engine/intake/submission.py)."""

from __future__ import annotations

import dataclasses

import pytest
from transformers import GenerationConfig

from tests.support.models import tiny_llama
from transformers_cb import ContinuousBatchingConfig
from transformers_cb.config.continuous_batching import resolve_speculation_max_batch
from transformers_cb.engine.build import wire
from transformers_cb.engine.intake.submission import RequestBuilder, Submission
from transformers_cb.engine.settings import resolve_settings
from transformers_cb.memory.cache_settings import CacheSettings
from transformers_cb.memory.host_cache import HostSettings
from transformers_cb.sampling.sampling_settings import SamplingSettings, resolve_sampling_settings
from transformers_cb.scheduler.scheduler_settings import SchedulerSettings, resolve_scheduler_settings

GREEDY = GenerationConfig(max_new_tokens=6, do_sample=False)


def test_the_settings_are_composed_of_the_parts_settings() -> None:
    config = ContinuousBatchingConfig(
        page_size=4, num_blocks=8, max_queue_size=5, scheduler_type="prefill_first", seed=3, top_logprobs=2
    )
    settings, _ = resolve_settings(tiny_llama(), GREEDY, config)
    assert isinstance(settings.cache, CacheSettings) and isinstance(settings.host, HostSettings)
    assert isinstance(settings.scheduler, SchedulerSettings) and isinstance(
        settings.sampling, SamplingSettings
    )
    for part in (settings, settings.cache, settings.host, settings.scheduler, settings.sampling):
        assert dataclasses.is_dataclass(part) and part.__dataclass_params__.frozen  # type: ignore[attr-defined]
    assert settings.scheduler == SchedulerSettings("prefill_first", config.resolved_safety_margin, 5, 8)
    assert (settings.sampling.seed, settings.sampling.top_logprobs, settings.sampling.all_request_stages) == (
        3,
        2,
        False,
    )
    assert settings.cache.page_size == settings.sizing.page_size == 4 and settings.cache.group_pages == (8,)
    assert settings.cache.kv_groups == settings.cache.layout.groups and settings.cache.sharing is True


def test_each_room_resolves_its_own_settings() -> None:
    config = ContinuousBatchingConfig(max_queue_size=2, speculation_max_batch_size=4)
    scheduler = resolve_scheduler_settings(config, resolve_speculation_max_batch(config, "cpu"))
    assert scheduler == SchedulerSettings(config.scheduler_type, config.resolved_safety_margin, 2, 4)
    model = tiny_llama()
    sampling = resolve_sampling_settings(model, GREEDY, config, all_request_stages=True)
    assert sampling.generation_config is not GREEDY and sampling.generation_config.max_new_tokens == 6
    assert sampling.all_request_stages and sampling.return_logprobs == config.return_logprobs
    with pytest.raises(ValueError):  # a field set that the package does not implement, refused here
        resolve_sampling_settings(model, GenerationConfig(num_beams=2), config)


def test_build_request_is_a_part_wired_from_the_settings() -> None:
    model = tiny_llama()
    settings, tp = resolve_settings(model, GREEDY, ContinuousBatchingConfig(page_size=4, num_blocks=8))
    engine = wire(model, settings, tp)
    builder = engine.build_request
    assert isinstance(builder, RequestBuilder) and "build_request" not in type(engine).__dict__
    # It checks against the settings and the engine's own parts, and nothing else of the engine.
    assert (
        builder.shape is settings.shape and builder.generation_config is settings.sampling.generation_config
    )
    assert builder.sampling is engine.sampling and builder.speculation is engine.speculation
    assert builder.pages is engine.pages
    request = engine.build_request(Submission([3, 4, 5], "r0"))
    assert request.max_new_tokens == 6 and request.sampling is None
    with pytest.raises(ValueError, match="request 'long'.*raise num_blocks"):
        engine.build_request(
            Submission([3] * 40, "long", max_new_tokens=4)
        )  # more pages than the cache holds
