"""engine/follower.py and engine/publisher.py in one process: rank 0 (a plain `Engine` whose publisher
sends each step) and a `FollowerEngine` (which replays it) over two coordinators joined by an in-memory
channel instead of the gloo group (tests/support/tp_pair.py). The follower decides nothing, yet ends with rank 0's tokens and the
same KV bytes. The real two-process runs are in tests/distributed/."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from tests.support.models import tiny_llama
from tests.support.prompts import prompts_of_lengths
from tests.support.tp_pair import engine_pair
from transformers_cb import ContinuousBatchingConfig
from transformers_cb.attention.selection import paged_backend
from transformers_cb.distributed import TensorParallelError
from transformers_cb.engine.engine import Engine
from transformers_cb.engine.follower import FollowerEngine
from transformers_cb.engine.intake.submission import Submission
from transformers_cb.engine.publisher import TensorParallelPublisher


@pytest.fixture
def pair():
    model = tiny_llama()
    config = ContinuousBatchingConfig(page_size=4, num_blocks=10, max_batch_tokens=16)
    driver, follower, channel = engine_pair(
        model, GenerationConfig(max_new_tokens=8, do_sample=False), config
    )
    return model, driver, follower, channel


def test_the_builder_makes_rank_0_a_publishing_engine_and_the_others_followers(pair) -> None:
    _, driver, follower, _ = pair
    assert type(driver) is Engine and isinstance(driver.publisher, TensorParallelPublisher)
    assert isinstance(follower, FollowerEngine) and type(follower.publisher).__name__ == "StepPublisher"
    assert (driver.rank, driver.is_follower, follower.rank, follower.is_follower) == (0, False, 1, True)


def test_the_follower_replays_rank_0_step_by_step(pair) -> None:
    model, driver, follower, channel = pair
    prompts = prompts_of_lengths([13, 6, 9, 11], seed=5)  # 10 pages of 4 tokens: preemptions on rank 0
    with paged_backend(model, driver.settings.step_options.attn_implementation), torch.inference_mode():
        requests = [driver.build_request(Submission(p, f"r{i}")) for i, p in enumerate(prompts)]
        mirrors = [follower.build_request(Submission(p, f"r{i}")) for i, p in enumerate(prompts)]
        for request, mirror in zip(requests, mirrors, strict=True):
            driver.add(request)
            follower.add(mirror)
        assert follower.has_work() and not follower.scheduler.has_work()  # mirrors, not scheduled
        while driver.has_work():
            driver.step()
            follower.step()
        while follower.has_work():  # the message that ends the run
            follower.step()
    assert channel.empty() and driver.scheduler.num_preemptions > 0
    assert [m.generated_ids for m in mirrors] == [r.generated_ids for r in requests]
    assert [m.status for m in mirrors] == [r.status for r in requests]
    assert follower.counters.steps == driver.counters.steps and follower.scheduler.num_preemptions == 0
    for mine, theirs in zip(follower.cache.group_tensors, driver.cache.group_tensors, strict=True):
        assert torch.equal(mine, theirs)  # the same forward over the same pages


def test_a_failed_forward_on_rank_0_breaks_the_group(pair, monkeypatch) -> None:
    model, driver, _, _ = pair

    def broken(batch):
        raise RuntimeError("boom")

    monkeypatch.setattr(driver.runner, "run", broken)
    request = driver.build_request(Submission([3, 4, 5], "r0"))
    driver.add(request)
    with (
        paged_backend(model, driver.settings.step_options.attn_implementation),
        pytest.raises(TensorParallelError, match="boom"),
    ):
        driver.step()
    assert not request.is_finished  # the group is over: no rank can fail it alone
