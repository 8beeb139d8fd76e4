"""The one table of neutral values (sampling/neutral.py) and the engine switch that builds every
per-request processor stage (`all_request_stages`, the server's engine)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import GenerationConfig

from tests.support.models import tiny_llama
from transformers_cb.config.generation_fields import resolve_generation_config
from transformers_cb.requests import Request
from transformers_cb.sampling.logits import openai, warpers
from transformers_cb.sampling.neutral import NEUTRAL_VALUES, is_neutral
from transformers_cb.sampling.params import OPENAI_PARAMS, VECTOR_PARAMS, SamplingParams
from transformers_cb.sampling.request_state import RequestSampling, SamplingSetup
from transformers_cb.sampling.sampler import Sampler

PROCESSOR_PARAMS = (*VECTOR_PARAMS, *OPENAI_PARAMS)
# One value away from neutral per processor: the test of each neutral value must be able to fail.
CHANGING = {"temperature": 0.5, "top_k": 3, "top_p": 0.5, "min_p": 0.3, "repetition_penalty": 1.5}


def test_request_defaults_are_the_tables_neutral_values() -> None:
    defaults = SamplingParams()
    for name in PROCESSOR_PARAMS:
        assert getattr(defaults, name) == NEUTRAL_VALUES[name], name
        assert is_neutral(name, getattr(defaults, name))
    assert not defaults.changes_logits
    for name in PROCESSOR_PARAMS:
        changed = dataclasses.replace(
            defaults, **{name: CHANGING.get(name, 1) if name != "logit_bias" else ((3, 1.0),)}
        )
        assert changed.changes_logits, name


@pytest.mark.parametrize("name", VECTOR_PARAMS)
def test_each_neutral_vector_value_leaves_its_row_unchanged(name: str) -> None:
    """Row 0 neutral, row 1 not: the per-row path runs, and row 0 comes out bit-identical."""
    torch.manual_seed(0)
    scores = torch.randn(2, 16)
    values = [NEUTRAL_VALUES[name], CHANGING[name]]
    if name == "repetition_penalty":
        out = warpers.repetition_penalty(scores, torch.ones(2, 16, dtype=torch.bool), values)
    else:
        out = getattr(warpers, name)(scores, values)
    assert torch.equal(out[0], scores[0])
    assert not torch.equal(out[1], scores[1])


def test_neutral_openai_values_leave_the_logits_unchanged() -> None:
    request = Request("r", [1, 2, 3], max_new_tokens=4)
    request.append_token(5)
    neutral = RequestSampling(params=SamplingParams(), row_processors=[])
    scores = torch.randn(1, 16)
    assert torch.equal(openai.apply(scores, [request], [neutral]), scores)
    biased = RequestSampling(params=SamplingParams(presence_penalty=1.0), row_processors=[])
    assert not torch.equal(openai.apply(scores, [request], [biased]), scores)


def test_the_servers_fields_are_left_out_at_the_tables_neutral_values() -> None:
    pytest.importorskip("pydantic")
    from transformers_cb.serve.protocol import ENGINE_FIELDS, CompletionRequest

    assert all(keyword in NEUTRAL_VALUES for _, keyword in ENGINE_FIELDS)
    neutral = {name: NEUTRAL_VALUES[keyword] for name, keyword in ENGINE_FIELDS if name != "logit_bias"}
    body = CompletionRequest(model="m", prompt="x", **neutral)
    assert body.engine_kwargs() == {}
    body = CompletionRequest(model="m", prompt="x", **{**neutral, "top_p": 0.5, "top_k": -1})
    assert body.engine_kwargs() == {"top_p": 0.5}


# -- all_request_stages --------------------------------------------------------------------------
def _setups() -> tuple[SamplingSetup, SamplingSetup]:
    """The server's engine before the switch (a GenerationConfig whose non-default values made every
    vectorized processor exist) and with it."""
    model = tiny_llama()
    enabling = GenerationConfig(
        do_sample=True, temperature=0.5, top_k=50, top_p=0.5, min_p=0.0, repetition_penalty=1.5
    )
    plain = GenerationConfig(do_sample=True)
    device = torch.device("cpu")
    before = SamplingSetup(resolve_generation_config(model, enabling), device, per_request_processors=True)
    after = SamplingSetup(
        resolve_generation_config(model, plain), device, per_request_processors=True, all_request_stages=True
    )
    return before, after


REQUESTS = [
    {},  # OpenAI's default: samples at temperature 1
    {"do_sample": False},  # temperature=0
    {"temperature": 0.7, "top_k": 5, "seed": 3},
    {"top_p": 0.9, "min_p": 0.1, "repetition_penalty": 1.2, "presence_penalty": 0.5, "logit_bias": {4: 2.0}},
]


def test_all_request_stages_builds_what_the_enabling_config_built_with_neutral_defaults() -> None:
    before, after = _setups()
    assert [(s.kind, s.name) for s in after.stages] == [(s.kind, s.name) for s in before.stages]
    assert {s.name for s in after.stages if s.kind == "vector"} == set(VECTOR_PARAMS)
    for name in VECTOR_PARAMS:
        assert getattr(after.base, name) == NEUTRAL_VALUES[name]
    assert before.base.temperature == 0.5  # the enabling values: the server overrode each


@pytest.mark.parametrize("kwargs", REQUESTS)
def test_all_request_stages_samples_as_the_enabling_config_with_neutral_overrides(kwargs: dict) -> None:
    """Before the switch the server passed the neutral value of every processor a request left out;
    with it, a request passes only what it sets, and its scores and tokens are the same."""
    before, after = _setups()
    torch.manual_seed(1)
    logits = torch.randn(1, 32)
    outputs = []
    for setup, given in (
        (before, {**{n: NEUTRAL_VALUES[n] for n in VECTOR_PARAMS}, **kwargs}),
        (after, kwargs),
    ):
        request = Request("r", [1, 2, 3, 2], max_new_tokens=4)
        setup.attach(request, given)
        sampler = Sampler(setup.stages, setup.do_sample, torch.device("cpu"), setup.grammars)
        outputs.append(
            (request.sampling and request.sampling.params, sampler.process(logits.clone(), [request]))
        )
    (params_before, scores_before), (params_after, scores_after) = outputs
    assert params_after == params_before
    assert torch.equal(scores_after, scores_before)
    if kwargs.get("do_sample") is not False:
        assert params_after is not None and params_after.do_sample


def test_without_the_switch_transformers_rule_holds() -> None:
    setup = SamplingSetup(GenerationConfig(do_sample=True), torch.device("cpu"), per_request_processors=True)
    assert not any(s.kind == "vector" for s in setup.stages)
    with pytest.raises(ValueError, match="needs the GenerationConfig to create the temperature processor"):
        setup.attach(Request("r", [1], max_new_tokens=2), {"temperature": 0.7})
