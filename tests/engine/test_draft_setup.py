"""Which engines may speculate: tensor parallelism refuses it with the reason, and an engine whose
`speculation.refusal` is set (models with recurrent per-request state) refuses speculating requests at
submission and a GenerationConfig that asks for it at start, naming the input."""

from __future__ import annotations

import pytest
from transformers import GenerationConfig

from tests.support.hybrids import build_hybrid
from tests.support.models import tiny_llama
from transformers_cb.engine.build import build_engine
from transformers_cb.engine.intake.submission import Submission, make_submission
from transformers_cb.engine.speculation.draft_setup import speculation_refusal
from transformers_cb.scheduler.speculation.prompt_lookup import PROMPT_LOOKUP


def test_tensor_parallelism_refuses_speculation() -> None:
    model = tiny_llama()
    assert speculation_refusal(model) is None
    model._tp_size = 2
    assert "tensor parallelism" in (speculation_refusal(model) or "")


def test_an_engine_that_cannot_speculate_refuses_speculating_requests() -> None:
    model = tiny_llama()
    engine = build_engine(model, GenerationConfig(max_new_tokens=4), None)
    assert engine.speculation.refusal is None
    request = engine.build_request(make_submission([5, 6, 7], "a", {"prompt_lookup_num_tokens": 3}))
    assert request.speculation is not None and request.speculation.max_tokens == 3
    engine.speculation.refusal = "state layers cannot roll back"
    assert engine.speculation.refusal is not None
    with pytest.raises(ValueError, match="request 'b'.*state layers cannot roll back"):
        engine.build_request(make_submission([5, 6, 7], "b", {"prompt_lookup_num_tokens": 3}))
    assert engine.build_request(Submission([5, 6, 7], "c")).speculation is None


def test_a_generation_config_with_prompt_lookup_is_every_requests_default(monkeypatch) -> None:
    model = tiny_llama()
    engine = build_engine(
        model, GenerationConfig(max_new_tokens=4, prompt_lookup_num_tokens=5, max_matching_ngram_size=3), None
    )
    request = engine.build_request(Submission([5, 6, 7], "a"))
    assert request.speculation is not None
    assert (request.speculation.max_tokens, request.speculation.max_ngram) == (5, 3)
    off = engine.build_request(make_submission([5, 6, 7], "b", {"prompt_lookup_num_tokens": 0}))
    assert off.speculation is None
    monkeypatch.setattr(
        "transformers_cb.engine.settings.speculation_refusal",
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
    assert engine.speculation.refusal is not None
    with pytest.raises(ValueError, match="request 'a'.*state layers"):
        engine.build_request(make_submission([5, 6, 7], "a", {"prompt_lookup_num_tokens": 3}))
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens.*state layers"):
        build_engine(model, GenerationConfig(max_new_tokens=4, prompt_lookup_num_tokens=3), None)
    assert engine.build_request(Submission([5, 6, 7], "b")).speculation is None


# -- a draft model (assistant_model) -------------------------------------------------------------------
def test_an_assistant_with_another_vocabulary_is_refused() -> None:
    with pytest.raises(ValueError, match=r"assistant_model: its vocab_size \(301\) differs.*\(300\)"):
        build_engine(
            tiny_llama(), GenerationConfig(max_new_tokens=4), None, assistant_model=tiny_llama(vocab_size=301)
        )
    with pytest.raises(ValueError, match="assistant_model must be a transformers PreTrainedModel"):
        build_engine(tiny_llama(), GenerationConfig(max_new_tokens=4), None, assistant_model="small")


def test_state_layers_on_either_side_and_tensor_parallelism_refuse_an_assistant() -> None:
    hybrid = build_hybrid("qwen3_5")
    vocab = hybrid.config.get_text_config().vocab_size
    with pytest.raises(ValueError, match="assistant_model: models with state layers"):
        build_engine(
            tiny_llama(vocab_size=vocab), GenerationConfig(max_new_tokens=4), None, assistant_model=hybrid
        )
    with pytest.raises(ValueError, match="assistant_model: speculative decoding.*state layers"):
        build_engine(
            hybrid, GenerationConfig(max_new_tokens=4), None, assistant_model=tiny_llama(vocab_size=vocab)
        )
    target, assistant = tiny_llama(), tiny_llama(num_hidden_layers=1)
    target._tp_size = 2
    with pytest.raises(ValueError, match="assistant_model: .*tensor parallelism"):
        build_engine(target, GenerationConfig(max_new_tokens=4), None, assistant_model=assistant)
    assistant._tp_size = 2
    with pytest.raises(ValueError, match="assistant_model: a tensor-parallel assistant"):
        build_engine(tiny_llama(), GenerationConfig(max_new_tokens=4), None, assistant_model=assistant)


def test_assistant_settings_per_request_and_their_refusals() -> None:
    model, assistant = tiny_llama(), tiny_llama(num_hidden_layers=1)
    plain = build_engine(model, GenerationConfig(max_new_tokens=4), None)
    with pytest.raises(ValueError, match=r"request 'a'.*\['num_assistant_tokens'\] need an assistant_model"):
        plain.build_request(make_submission([5, 6, 7], "a", {"num_assistant_tokens": 3}))
    assistant.generation_config.num_assistant_tokens = 7  # where transformers reads it
    engine = build_engine(model, GenerationConfig(max_new_tokens=4), None, assistant_model=assistant)
    request = engine.build_request(Submission([5, 6, 7], "a"))
    state = request.speculation
    assert state is not None and state.max_tokens == 7
    assert state.source is engine.drafter  # the draft model's source; its settings per request:
    assert (state.assistant.schedule, state.assistant.confidence) == ("constant", 0.4)
    own = engine.build_request(
        make_submission(
            [5, 6, 7],
            "b",
            {
                "num_assistant_tokens": 3,
                "num_assistant_tokens_schedule": "heuristic",
                "assistant_confidence_threshold": 0.0,
            },
        )
    )
    assert own.speculation.max_tokens == 3 and own.speculation.assistant.schedule == "heuristic"
    assert (
        engine.build_request(make_submission([5, 6, 7], "c", {"num_assistant_tokens": 0})).speculation is None
    )
    lookup = engine.build_request(make_submission([5, 6, 7], "d", {"prompt_lookup_num_tokens": 2}))
    assert lookup.speculation.source is PROMPT_LOOKUP  # prompt lookup wins, as in generate()
    for bad in (
        {"num_assistant_tokens": -1},
        {"num_assistant_tokens_schedule": "sometimes"},
        {"assistant_confidence_threshold": 2.0},
    ):
        with pytest.raises(ValueError, match="request 'e'"):
            engine.build_request(make_submission([5, 6, 7], "e", bad))
    # The engine's GenerationConfig, where set, over the assistant's; forks draft each on their own.
    config = GenerationConfig(
        max_new_tokens=4, num_assistant_tokens=5, num_assistant_tokens_schedule="heuristic"
    )
    engine = build_engine(model, config, None, assistant_model=assistant)
    parent = engine.build_request(Submission([5, 6, 7], "f", num_return_sequences=2))
    (child,) = parent.siblings
    assert parent.speculation.max_tokens == child.speculation.max_tokens == 5
    assert parent.speculation is not child.speculation
    assert parent.speculation.assistant is not child.speculation.assistant
    with pytest.raises(ValueError, match="num_assistant_tokens_schedule must be one of"):
        build_engine(
            model,
            GenerationConfig(max_new_tokens=4, num_assistant_tokens_schedule="x"),
            None,
            assistant_model=assistant,
        )
