"""Which engines may speculate: tensor parallelism refuses it with the reason, and an engine whose
`speculation_refusal` is set (models with recurrent per-request state) refuses speculating requests at
submission and a GenerationConfig that asks for it at start, naming the input."""

from __future__ import annotations

import pytest
from transformers import GenerationConfig

from tests.support.models import tiny_llama
from transformers_cb.engine.build import build_engine
from transformers_cb.engine.speculation_support import speculation_refusal


def test_tensor_parallelism_refuses_speculation() -> None:
    model = tiny_llama()
    assert speculation_refusal(model) is None
    model._tp_size = 2
    assert "tensor parallelism" in (speculation_refusal(model) or "")


def test_an_engine_that_cannot_speculate_refuses_speculating_requests() -> None:
    model = tiny_llama()
    engine = build_engine(model, GenerationConfig(max_new_tokens=4), None)
    assert engine.supports_speculation
    request = engine.build_request([5, 6, 7], "a", sampling_kwargs={"prompt_lookup_num_tokens": 3})
    assert request.speculation is not None and request.speculation.max_tokens == 3
    engine.speculation_refusal = "state layers cannot roll back"
    assert not engine.supports_speculation
    with pytest.raises(ValueError, match="request 'b'.*state layers cannot roll back"):
        engine.build_request([5, 6, 7], "b", sampling_kwargs={"prompt_lookup_num_tokens": 3})
    assert engine.build_request([5, 6, 7], "c").speculation is None


def test_a_generation_config_with_prompt_lookup_is_every_requests_default(monkeypatch) -> None:
    model = tiny_llama()
    engine = build_engine(
        model, GenerationConfig(max_new_tokens=4, prompt_lookup_num_tokens=5, max_matching_ngram_size=3), None
    )
    request = engine.build_request([5, 6, 7], "a")
    assert request.speculation is not None
    assert (request.speculation.max_tokens, request.speculation.max_ngram) == (5, 3)
    off = engine.build_request([5, 6, 7], "b", sampling_kwargs={"prompt_lookup_num_tokens": 0})
    assert off.speculation is None
    monkeypatch.setattr("transformers_cb.engine.engine.speculation_refusal", lambda model: "no rollback")
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens: no rollback"):
        build_engine(model, GenerationConfig(max_new_tokens=4, prompt_lookup_num_tokens=5), None)
