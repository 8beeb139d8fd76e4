"""The conformance check's runs (parity/check.py): its evictions column is the engine's own count of
preemptions, and reading it leaves the model's cached engine as it was."""

from __future__ import annotations

from tests.support.models import tiny_llama, vocab_size
from tests.support.preemptions import count_preemptions
from transformers_cb.api.generate_batch import CACHED_ENGINE_ATTR
from transformers_cb.conformance_check import random_prompts, run_check

ROOMY = ("roomy", {"page_size": 16})
# 4 prompts of 20-30 tokens + 6 new ones on 4-token pages: 9 pages is one request's worth, plus one.
TIGHT = ("tight", {"page_size": 4, "max_batch_tokens": 16, "num_blocks": 10})


def test_evictions_are_the_engines_preemptions_of_each_setting() -> None:
    model = tiny_llama()
    prompts = random_prompts(4, vocab_size(model), 20, 30, seed=1, avoid=(0, 1, 2))
    with count_preemptions() as preempted:
        roomy, tight = run_check(model, prompts, 6, settings=[ROOMY, TIGHT])
    assert roomy.passed and tight.passed, (roomy.details, tight.details)
    assert roomy.num_preemptions == 0
    assert tight.num_preemptions == len(preempted) > 0


def test_the_models_cached_engine_is_put_back() -> None:
    model = tiny_llama()
    prompts = random_prompts(2, vocab_size(model), 3, 6, seed=2)
    run_check(model, prompts, 2, settings=[ROOMY])
    assert not hasattr(model, CACHED_ENGINE_ATTR)
    held = ("key", object())
    setattr(model, CACHED_ENGINE_ATTR, held)
    (result,) = run_check(model, prompts, 2, settings=[ROOMY])
    assert result.passed and getattr(model, CACHED_ENGINE_ATTR) is held
