"""engine/plan.py: the `EnginePlan` composed of one frozen sub-plan per part, each resolved by its room, and
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
from transformers_cb.engine.plan import resolve_plan
from transformers_cb.memory.cache_plan import CachePlan
from transformers_cb.memory.host_cache import HostPlan
from transformers_cb.sampling.sampling_plan import SamplingPlan, resolve_sampling_plan
from transformers_cb.scheduler.scheduler_plan import SchedulerPlan, resolve_scheduler_plan

GREEDY = GenerationConfig(max_new_tokens=6, do_sample=False)


def test_the_plan_is_composed_of_the_parts_plans() -> None:
    config = ContinuousBatchingConfig(
        page_size=4, num_blocks=8, max_queue_size=5, scheduler_type="prefill_first", seed=3, top_logprobs=2
    )
    plan, _ = resolve_plan(tiny_llama(), GREEDY, config)
    assert isinstance(plan.cache, CachePlan) and isinstance(plan.host, HostPlan)
    assert isinstance(plan.scheduler, SchedulerPlan) and isinstance(plan.sampling, SamplingPlan)
    for part in (plan, plan.cache, plan.host, plan.scheduler, plan.sampling):
        assert dataclasses.is_dataclass(part) and part.__dataclass_params__.frozen  # type: ignore[attr-defined]
    assert plan.scheduler == SchedulerPlan("prefill_first", config.resolved_safety_margin, 5, 8)
    assert (plan.sampling.seed, plan.sampling.top_logprobs, plan.sampling.all_request_stages) == (3, 2, False)
    assert plan.cache.page_size == plan.sizing.page_size == 4 and plan.cache.group_pages == (8,)
    assert plan.cache.kv_groups == plan.cache.layout.groups and plan.cache.sharing is True


def test_each_room_resolves_its_own_plan() -> None:
    config = ContinuousBatchingConfig(max_queue_size=2, speculation_max_batch_size=4)
    scheduler = resolve_scheduler_plan(config, resolve_speculation_max_batch(config, "cpu"))
    assert scheduler == SchedulerPlan(config.scheduler_type, config.resolved_safety_margin, 2, 4)
    model = tiny_llama()
    sampling = resolve_sampling_plan(model, GREEDY, config, all_request_stages=True)
    assert sampling.generation_config is not GREEDY and sampling.generation_config.max_new_tokens == 6
    assert sampling.all_request_stages and sampling.return_logprobs == config.return_logprobs
    with pytest.raises(ValueError):  # a field set that the package does not implement, refused here
        resolve_sampling_plan(model, GenerationConfig(num_beams=2), config)


def test_build_request_is_a_part_wired_from_the_plan() -> None:
    model = tiny_llama()
    plan, tp = resolve_plan(model, GREEDY, ContinuousBatchingConfig(page_size=4, num_blocks=8))
    engine = wire(model, plan, tp)
    builder = engine.build_request
    assert isinstance(builder, RequestBuilder) and "build_request" not in type(engine).__dict__
    # It checks against the plan and the engine's own parts, and nothing else of the engine.
    assert builder.shape is plan.shape and builder.generation_config is plan.sampling.generation_config
    assert builder.sampling is engine.sampling and builder.speculation is engine.speculation
    assert builder.pages is engine.pages
    request = engine.build_request(Submission([3, 4, 5], "r0"))
    assert request.max_new_tokens == 6 and request.sampling is None
    with pytest.raises(ValueError, match="request 'long'.*raise num_blocks"):
        engine.build_request(
            Submission([3] * 40, "long", max_new_tokens=4)
        )  # more pages than the cache holds
