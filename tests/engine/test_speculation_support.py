"""Which engines may speculate: tensor parallelism refuses it with the reason, and an engine whose
`speculation_refusal` is set (models with recurrent per-request state) refuses speculating requests at
submission and a GenerationConfig that asks for it at start, naming the input."""

from __future__ import annotations

import pytest
from transformers import GenerationConfig

from tests.support.hybrids import build_hybrid
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
    monkeypatch.setattr(
        "transformers_cb.engine.engine.speculation_refusal",
        lambda model, has_state_layers=False: "no rollback",
    )
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens: no rollback"):
        build_engine(model, GenerationConfig(max_new_tokens=4, prompt_lookup_num_tokens=5), None)


@pytest.mark.parametrize("name", ["qwen3_5", "mamba2"])
def test_models_with_state_layers_refuse_speculation(name: str) -> None:
    """A recurrent state that took in rejected draft tokens cannot be rolled back: refused by name, per
    request and from the GenerationConfig, while plain requests run."""
    model = build_hybrid(name)
    engine = build_engine(model, GenerationConfig(max_new_tokens=4), None)
    assert not engine.supports_speculation
    with pytest.raises(ValueError, match="request 'a'.*state layers"):
        engine.build_request([5, 6, 7], "a", sampling_kwargs={"prompt_lookup_num_tokens": 3})
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens.*state layers"):
        build_engine(model, GenerationConfig(max_new_tokens=4, prompt_lookup_num_tokens=3), None)
    assert engine.build_request([5, 6, 7], "b").speculation is None
