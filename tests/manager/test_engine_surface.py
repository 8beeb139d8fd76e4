"""The manager asks the engine, never its tensor-parallel coordinator: the loop ticks `heartbeat()` while
idle and calls `end_session()` once as its thread ends; on a follower (tests/support/tp_pair.py) the loop
runs `replay_session()` until rank 0's manager stops, and submissions are refused naming the rank."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from transformers import GenerationConfig

from tests.support.manager import CB_CONFIG, PROMPTS
from tests.support.threads import TIMEOUT, wait_for
from tests.support.tp_pair import engine_pair
from transformers_cb import ContinuousBatchingConfig, ContinuousBatchingManager
from transformers_cb.attention.selection import paged_backend
from transformers_cb.engine.follower import FollowerEngine
from transformers_cb.engine.intake.submission import Submission
from transformers_cb.engine.publisher import StepPublisher
from transformers_cb.manager import manager as manager_module


class CountingPublisher(StepPublisher):
    def __init__(self) -> None:
        self.idle_ticks = 0
        self.sessions_ended = 0

    def idle(self) -> None:
        self.idle_ticks += 1

    def session_ended(self) -> None:
        self.sessions_ended += 1


def test_the_loop_ticks_while_idle_and_ends_the_engines_session(manager) -> None:
    manager.engine.publisher = publisher = CountingPublisher()
    manager.start()
    wait_for(lambda: publisher.idle_ticks >= 2, what="idle heartbeats")
    assert publisher.sessions_ended == 0
    manager.stop(timeout=TIMEOUT)
    assert not manager.is_running() and publisher.sessions_ended == 1


def test_a_follower_manager_replays_rank_0_until_its_session_ends(model) -> None:
    config = ContinuousBatchingConfig(**CB_CONFIG)
    driver, follower, channel = engine_pair(
        model, GenerationConfig(max_new_tokens=5, do_sample=False), config
    )
    assert isinstance(follower, FollowerEngine)
    with mock.patch.object(manager_module, "build_engine", return_value=follower):
        manager = ContinuousBatchingManager(model, continuous_batching_config=config)
    assert manager.engine is follower
    with pytest.raises(RuntimeError, match="this is rank 1"):
        manager.add_request(PROMPTS[0], max_new_tokens=5)
    # Rank 0's whole session first (the channel keeps its messages), then the follower's manager replays it.
    with paged_backend(model, driver.settings.step_options.attn_implementation), torch.inference_mode():
        for i, prompt in enumerate(PROMPTS[:3]):
            driver.add(driver.build_request(Submission(prompt, f"r{i}", max_new_tokens=5)))
        while driver.has_work():
            driver.step()
    driver.end_session()  # STOP: the follower's session ends with rank 0's
    manager.start()
    wait_for(lambda: not manager.is_running(), what="the follower's session to end at rank 0's STOP")
    assert channel.empty() and manager.background_thread_status.fatal_error is None
    assert follower.counters.steps == driver.counters.steps > 0
    manager.destroy()
