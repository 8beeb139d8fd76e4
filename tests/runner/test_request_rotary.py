"""Per-request rotary (runner/request_rotary.py): a dynamic rotary embedding (LongRoPE, dynamic NTK) gives
each request's rows what `generate()` gives that request alone, whatever else the packed step holds.

The tiny models (`tests.support.models.ROPE_MODELS`) switch at 32 tokens and have sharpened attention, so a
wrong frequency set changes the tokens: on a packed step whose largest position decides for every request
(transformers' own rule), these tests fail. The references are a fresh model's `generate()` per request
(dynamic NTK's rotary embedding is stateful).
"""

from __future__ import annotations

import pytest
from transformers import GenerationConfig

import transformers_cb  # noqa: F401  (installs the plugin)
from tests.support.models import ROPE_MODELS, tiny_phi3_longrope
from tests.support.prompts import random_prompts
from tests.support.reference import greedy_reference
from transformers_cb import ContinuousBatchingConfig
from transformers_cb.engine.build import build_engine
from transformers_cb.engine.intake.submission import Submission
from transformers_cb.runner.request_rotary import dynamic_rotary_modules


def prompts_of(lengths: list[int], seed: int = 3) -> list[list[int]]:
    return [p[:n] for p, n in zip(random_prompts(len(lengths), 300, 40, 40, seed=seed), lengths, strict=True)]


def fresh_references(family: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    return [greedy_reference(ROPE_MODELS[family](), p, max_new_tokens) for p in prompts]


def run(model, prompts: list[list[int]], max_new_tokens: int, **cb) -> list[list[int]]:
    outputs = model.generate_batch(
        prompts,
        generation_config=GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None),
        continuous_batching_config=ContinuousBatchingConfig(**cb),
        progress_bar=False,
    )
    return [outputs[f"req_{i}"].generated_tokens for i in range(len(prompts))]


@pytest.mark.parametrize("family", ["phi3_longrope", "llama_longrope"])
def test_longrope_pair_batched_equals_generate(family: str) -> None:
    """A 40-token prompt (long factors) and a 30-token one (short until it passes 32) in one step."""
    prompts = prompts_of([40, 30])
    assert run(ROPE_MODELS[family](), prompts, 8) == fresh_references(family, prompts, 8)


@pytest.mark.parametrize("family", ["phi3_longrope", "llama_longrope"])
def test_longrope_alone_past_the_switch_with_chunked_prefill(family: str) -> None:
    """Alone, with 16-token steps: the prompt's chunks see other lengths than `generate()`'s one prefill."""
    prompts = prompts_of([28], seed=5)
    assert run(ROPE_MODELS[family](), prompts, 12, max_batch_tokens=16) == fresh_references(
        family, prompts, 12
    )


def test_dynamic_ntk_past_max_positions_equals_fresh_generate() -> None:
    """Prompts of 20, 30 and 38 tokens with 12 new ones each, past the 32 native positions: not refused,
    and each equals a fresh model's `generate()`, batched and in 16-token steps."""
    prompts = prompts_of([20, 30, 38])
    references = fresh_references("llama_dynamic", prompts, 12)
    model = ROPE_MODELS["llama_dynamic"]()
    assert run(model, prompts, 12) == references
    assert run(model, prompts, 12, max_batch_tokens=16) == references


def test_rotary_forward_restored_and_state_untouched() -> None:
    """The per-request forward is installed for the run only; the module's own frequencies stay."""
    model = tiny_phi3_longrope()
    (module,) = dynamic_rotary_modules(model)
    before = module.inv_freq.clone()
    run(model, prompts_of([40, 30]), 4)
    assert "forward" not in module.__dict__
    assert (module.inv_freq == before).all()


def test_prefix_across_the_switch_is_not_reused() -> None:
    """A 24-token prompt's pages (short factors) are not hit by a 40-token prompt starting with it (long
    factors), whose output stays `generate()`'s; a 28-token one (short) does hit them."""
    model = tiny_phi3_longrope()
    engine = build_engine(
        model,
        GenerationConfig(do_sample=False, max_new_tokens=6, eos_token_id=None),
        ContinuousBatchingConfig(page_size=4, max_batch_tokens=64),
    )
    base = prompts_of([40], seed=7)[0]
    stats = present_stats(engine)

    def serve(prompt: list[int], request_id: str) -> list[int]:
        request = engine.build_request(Submission(prompt, request_id))
        with engine.session():
            engine.add(request)
            while engine.has_work():
                engine.step()
                engine.check_integrity()
        return request.to_output().generated_tokens

    serve(base[:24], "short")
    long_tokens = serve(base, "long")
    assert long_tokens == greedy_reference(tiny_phi3_longrope(), base, 6)
    assert stats.hit_tokens == 0
    assert serve(base[:28], "short_again") == greedy_reference(tiny_phi3_longrope(), base[:28], 6)
    assert stats.hit_tokens > 0


def present_stats(engine):
    prefix = engine.scheduler.pages.prefix
    assert prefix is not None, "prefix sharing is off"
    return prefix.stats
