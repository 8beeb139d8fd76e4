"""Speculative decoding with a draft model (`assistant_model`) is exact: greedy outputs equal `generate()`
token for token and equal the same requests without speculation, on the full-attention, sliding and hybrid
families, with a roomy cache and under preemption (chunked prefill mixed with verification rows; the
drafter's shadows freed and caught up again), with forks; eos and `max_new_tokens` cut a verified run
exactly where plain decoding stops. The assistant is the model's first layer (embeddings, one layer, norm
and head: some drafts are accepted, which every test checks, so none passes vacuously) or the model itself
(every draft must be accepted: a drafter whose KV were rolled back or caught up wrongly would draft
something else). The engine's integrity check, the drafter's included, runs after every step, and every
page of both caches is back at the end.
"""

from __future__ import annotations

import pytest
from transformers import GenerationConfig

from conformance.common import ReferenceCache, check_parity, count_preemptions, greedy_config
from conformance.test_parity_offload import pressure_num_blocks
from conformance.test_speculation import assert_accepted, engines_checked, repeating_prompts, verified_runs
from tests.support.models import backends_for, build_tiny_model, first_layers, using_backend
from transformers_cb import ContinuousBatchingConfig

# Every step speculates, whatever the batch (the CPU default stops at 8 running requests).
ALWAYS = 10**6

MAX_NEW_TOKENS = 24
DRAFT = 4
FAMILIES = ("llama", "mistral", "gemma3")  # full attention; sliding window; hybrid (sliding + full)


def assisted_config(eos_token_id=None, **fields) -> GenerationConfig:
    """Greedy, with `DRAFT` assistant tokens and no confidence cut (random models are never confident)."""
    config = greedy_config(MAX_NEW_TOKENS, eos_token_id)
    config.num_assistant_tokens = fields.pop("num_assistant_tokens", DRAFT)
    config.assistant_confidence_threshold = fields.pop("assistant_confidence_threshold", 0.0)
    for name, value in fields.items():
        setattr(config, name, value)
    return config


def generate(model, prompts, cb_config: ContinuousBatchingConfig, assistant=None, **kwargs):
    config = assisted_config(kwargs.pop("eos_token_id", None), **kwargs.pop("fields", {}))
    extra = {"assistant_model": assistant} if assistant is not None else {}
    return model.generate_batch(
        prompts, config, continuous_batching_config=cb_config, progress_bar=False, **extra, **kwargs
    )


@pytest.fixture(scope="module")
def _models() -> dict:
    return {}


def _model(cache: dict, family: str):
    if family not in cache:
        model = build_tiny_model(family, seed=0)
        cache[family] = (
            model,
            first_layers(model, 1),
            repeating_prompts(model),
            ReferenceCache(model, MAX_NEW_TOKENS),
        )
    return cache[family]


def assert_all_pages_back(engine) -> None:
    assert engine.num_used_pages == 0
    assert engine.drafter is not None and engine.drafter.num_used_pages == 0
    assert not engine.drafter.sequences


@pytest.mark.parametrize("pressure", [False, True], ids=["roomy", "preemption"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_assisted_equals_generate_and_plain(_models, family: str, pressure: bool) -> None:
    model, assistant, prompts, references = _model(_models, family)
    page_size = 4
    num_blocks = pressure_num_blocks(model, prompts, page_size) if pressure else None
    cb_config = ContinuousBatchingConfig(
        speculation_max_batch_size=ALWAYS, page_size=page_size, max_batch_tokens=16, num_blocks=num_blocks
    )
    context = f"{family}, num_blocks={num_blocks}"
    with using_backend(model, family, backends_for(family)[0]):
        plain = generate(model, prompts, cb_config)
        with engines_checked() as engines, count_preemptions() as preemptions:
            outputs = generate(model, prompts, cb_config, assistant)
    check_parity(model, prompts, outputs, [references.get(p) for p in prompts], context)
    for request_id, output in outputs.items():
        assert output.generated_tokens == plain[request_id].generated_tokens, f"{context}: {request_id}"
    assert_accepted(outputs)
    if pressure:
        assert preemptions, f"{context}: nothing was preempted"
    (engine,) = engines
    assert_all_pages_back(engine)
    snapshot = engine.snapshot()
    assert snapshot.speculation.drafted == sum(o.draft_tokens for o in outputs.values())
    assert snapshot.speculation.accepted == sum(o.accepted_draft_tokens for o in outputs.values())


@pytest.mark.parametrize("pressure", [False, True], ids=["roomy", "preemption"])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_the_model_as_its_own_assistant_has_every_draft_accepted(
    _models, family: str, pressure: bool
) -> None:
    model, _assistant, prompts, references = _model(_models, family)
    page_size = 4
    num_blocks = pressure_num_blocks(model, prompts, page_size) if pressure else None
    cb_config = ContinuousBatchingConfig(
        speculation_max_batch_size=ALWAYS, page_size=page_size, max_batch_tokens=16, num_blocks=num_blocks
    )
    with (
        using_backend(model, family, backends_for(family)[0]),
        engines_checked() as engines,
        count_preemptions() as preemptions,
    ):
        outputs = generate(model, prompts, cb_config, model)
    check_parity(model, prompts, outputs, [references.get(p) for p in prompts], family)
    if pressure:  # preempted requests' shadows were freed, and caught up again from scratch
        assert preemptions, f"{family}: nothing was preempted"
    drafted = sum(o.draft_tokens for o in outputs.values())
    accepted = sum(o.accepted_draft_tokens for o in outputs.values())
    assert drafted > 0 and accepted == drafted, (accepted, drafted)
    assert all(o.tokens_per_step > 2 for o in outputs.values())
    assert_all_pages_back(engines[0])


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_forks_draft_with_the_assistant(_models, family: str) -> None:
    model, assistant, prompts, references = _model(_models, family)
    cb_config = ContinuousBatchingConfig(speculation_max_batch_size=ALWAYS, page_size=4, max_batch_tokens=32)
    with using_backend(model, family, backends_for(family)[0]), engines_checked() as engines:
        outputs = generate(model, prompts, cb_config, assistant, num_return_sequences=2)
    assert len(outputs) == 2 * len(prompts)
    for i, prompt in enumerate(prompts):
        for request_id in (f"req_{i}", f"req_{i}__child#0"):
            assert outputs[request_id].generated_tokens == references.get(prompt), request_id
    assert_accepted(outputs)
    assert_all_pages_back(engines[0])


def test_max_new_tokens_and_eos_cut_inside_an_assisted_run(_models) -> None:
    model, assistant, prompts, references = _model(_models, "llama")
    cb_config = ContinuousBatchingConfig(speculation_max_batch_size=ALWAYS, page_size=4, max_batch_tokens=64)
    prompt = prompts[0]
    limits = list(range(1, MAX_NEW_TOKENS + 1))
    with verified_runs() as runs:
        outputs = generate(model, [prompt] * len(limits), cb_config, model, max_new_tokens=limits)
    for i, limit in enumerate(limits):
        assert outputs[f"req_{i}"].generated_tokens == references.get(prompt)[:limit], limit
        assert outputs[f"req_{i}"].finish_reason == "length"
    assert_accepted(outputs)
    # Drafts stop short of max_new_tokens (the target's own token is the last one): no run is cut by it.
    assert all(appended == verified for verified, appended in runs)
    assert any(verified > 1 for verified, _ in runs)
    expected = references.get(prompt)
    eos = expected[-3]
    cut = expected[: expected.index(eos) + 1]
    for draft_model in (model, assistant):
        outputs = generate(model, prompts[:1], cb_config, draft_model, eos_token_id=eos)
        assert outputs["req_0"].generated_tokens == cut
        assert outputs["req_0"].finish_reason == "stop"
    assert_accepted(outputs)


def test_heuristic_schedule_grows_drafts_that_are_accepted(_models) -> None:
    """transformers' "heuristic" schedule: +2 after a fully accepted draft (the model as its own assistant
    accepts all), "constant" keeps `num_assistant_tokens`; a confidence threshold of 1 cuts every draft to
    one token (no token is certain)."""
    model, _assistant, prompts, _references = _model(_models, "llama")
    cb_config = ContinuousBatchingConfig(speculation_max_batch_size=ALWAYS, page_size=4, max_batch_tokens=64)
    plain = generate(model, prompts[:1], cb_config, max_new_tokens=40)["req_0"].generated_tokens
    lengths = {}
    for schedule in ("constant", "heuristic", "heuristic_transient"):
        with verified_runs() as runs:
            outputs = generate(
                model,
                prompts[:1],
                cb_config,
                model,
                max_new_tokens=40,
                fields={"num_assistant_tokens": 2, "num_assistant_tokens_schedule": schedule},
            )
        assert outputs["req_0"].generated_tokens == plain, schedule
        lengths[schedule] = [verified - 1 for verified, _ in runs]
    assert lengths["constant"][:-1] == [2] * (len(lengths["constant"]) - 1)
    heuristic = lengths["heuristic"]
    assert heuristic[:4] == [2, 4, 6, 8], heuristic
    assert lengths["heuristic_transient"] == heuristic
    with verified_runs() as runs:
        outputs = generate(model, prompts, cb_config, model, fields={"assistant_confidence_threshold": 1.0})
    assert runs and all(verified == 2 for verified, _ in runs)
    assert_accepted(outputs)
