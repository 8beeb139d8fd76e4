"""The runner executes a step's whole plan in order: fork copies, then swaps, then released rows, then the
forward (scheduler/step_plan.py). A fork copy reads the last forward's KV, which a swap may move."""

from __future__ import annotations

from transformers import GenerationConfig

from tests.support.models import tiny_llama
from transformers_cb import ContinuousBatchingConfig
from transformers_cb.engine.build import build_engine
from transformers_cb.engine.intake.submission import Submission
from transformers_cb.kv.swap_plan import SwapPlan
from transformers_cb.scheduler.step_plan import StepPlan


def test_apply_runs_copies_then_swaps_then_releases() -> None:
    config = ContinuousBatchingConfig(page_size=4, num_blocks=8, cpu_offload_space=0.001)
    engine = build_engine(tiny_llama(), GenerationConfig(max_new_tokens=2, do_sample=False), config)
    runner = engine.runner
    assert runner.swapper is not None  # the runner owns the copier of the host tier
    calls = []
    runner.packer.cache.copy_pages = lambda copies: calls.append(("copies", copies))
    runner.swapper.run = lambda plan: calls.append(("swaps", plan.out_src))
    runner.packer.release_request = lambda request: calls.append(("release", request))
    request = engine.build_request(Submission([5, 6, 7], "r0"))
    batch = StepPlan(
        entries=[], copies=[(0, 1, 2)], swaps=SwapPlan(1, out_src=[[3]], out_dst=[[0]]), released=[request]
    )
    runner.apply(batch)
    assert calls == [("copies", [(0, 1, 2)]), ("swaps", [[3]]), ("release", request)]
