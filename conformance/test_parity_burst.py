"""Greedy parity under the server's scheduling policy, `decode_first`: a burst prefilled in shares of the
queue (scheduler/policies.py) equals `generate()`, with room to spare and under eviction.

40 prompts of 20-60 tokens arrive at once (about 1,600 prompt tokens: above `MIN_PREFILL_BUDGET`, so the
burst is split into steps of a sixth of it, each chunk at most half a step's budget), on the tiny Llama with
16-token pages; the engine's integrity check runs after every step, and the schedule is recorded to show the
burst was split and decodes ran beside its prefill.
"""

from __future__ import annotations

from unittest import mock

import pytest

from conformance.common import ReferenceCache, check_parity, greedy_config, run_batch, tight_num_blocks
from conformance.test_parity_sliding import integrity_checked
from tests.support.models import build_tiny_model, vocab_size
from tests.support.prompts import random_prompts
from transformers_cb.requests import RequestStatus
from transformers_cb.scheduler.policies import DecodeFirstPolicy
from transformers_cb.scheduler.scheduler import Scheduler

MAX_NEW_TOKENS = 8
PAGE_SIZE = 16


@pytest.fixture(scope="module")
def burst():
    model = build_tiny_model("llama", seed=0)
    prompts = random_prompts(40, vocab_size(model), 20, 60, seed=3)
    return model, prompts, ReferenceCache(model, MAX_NEW_TOKENS)


def recorded_schedules():
    """(prompt tokens, decode rows) of every step `Scheduler.schedule` plans."""
    steps: list[tuple[int, int]] = []
    original = Scheduler.schedule

    def schedule(self, drafts=None):
        plan = original(self, drafts)
        decodes = [e for e in plan.entries if e.request.status == RequestStatus.DECODING]
        steps.append((sum(e.num_tokens for e in plan.entries) - len(decodes), len(decodes)))
        return plan

    return steps, mock.patch.object(Scheduler, "schedule", schedule)


@pytest.mark.parametrize("tight", [False, True], ids=["roomy", "eviction"])
def test_a_burst_in_shares_equals_generate(burst, tight: bool) -> None:
    model, prompts, references = burst
    num_blocks = tight_num_blocks(prompts, MAX_NEW_TOKENS, PAGE_SIZE) + 2 if tight else None
    steps, patched = recorded_schedules()
    with patched, integrity_checked():
        outputs, preemptions = run_batch(
            model,
            prompts,
            greedy_config(MAX_NEW_TOKENS),
            page_size=PAGE_SIZE,
            num_blocks=num_blocks,
            scheduler_type="decode_first",
        )
    check_parity(
        model, prompts, outputs, [references.get(p) for p in prompts], f"decode_first, tight={tight}"
    )
    total = sum(map(len, prompts))
    budget = max(DecodeFirstPolicy.MIN_PREFILL_BUDGET, -(-total // DecodeFirstPolicy.SPLIT))
    assert all(prompt_tokens <= budget for prompt_tokens, _ in steps), steps[:8]
    if not tight:
        assert steps[0][0] < total  # the burst did not run in one step
        assert any(prompt_tokens and decodes for prompt_tokens, decodes in steps), (
            "no decode beside a prefill"
        )
    else:
        assert preemptions, "the tight cache evicted nobody: the eviction case is not exercised"
