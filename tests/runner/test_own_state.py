"""runner/states/own_state.py: the model-owned recurrences (MiniMax, RecurrentGemma, RWKV, xLSTM) split by request
at their slots: found by layer, their states learned by the probe, and a packed step (fresh spans, then a
decode batch) equal to each request's own forward."""

from __future__ import annotations

import pytest
import torch

from conformance.common import check_parity, greedy_config
from tests.support.hybrids import build_hybrid
from tests.support.reference import greedy_reference
from transformers_cb import ContinuousBatchingConfig
from transformers_cb.engine.settings import resolve_settings
from transformers_cb.invariants import InvariantError
from transformers_cb.memory.state_cache import CONV, RECURRENT, StateCache
from transformers_cb.model_check.state_probe import state_problems
from transformers_cb.runner.states.own_state import (
    MiniMaxCall,
    RecurrentGemmaCall,
    RwkvCall,
    XlstmCall,
    own_state_modules,
)
from transformers_cb.runner.states.state_layers import StateLayers, StateTable

# family -> (its call, its state layers, the layers whose continued chunks run a token at a time, the
# states of its first state layer as (kind, index))
FAMILIES = {
    "minimax": (MiniMaxCall, (0, 2), (), {(RECURRENT, 0)}),
    # RecurrentGemma's multi-token path restarts its convolution from zeros: stepwise.
    "recurrent_gemma": (RecurrentGemmaCall, (0, 1), (0, 1), {(CONV, 0), (RECURRENT, 0)}),
    "rwkv": (RwkvCall, (0, 1, 2, 3), (), {(RECURRENT, i) for i in range(5)}),
    "xlstm": (XlstmCall, (0, 1), (), {(RECURRENT, i) for i in range(3)}),
}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_probe_finds_each_family_by_layer(name: str) -> None:
    call_class, layers, stepwise, states = FAMILIES[name]
    model = build_hybrid(name)
    found = own_state_modules(model)
    assert tuple(sorted(found)) == layers
    assert all(isinstance(call, call_class) for _, call in found.values())
    layout, problems = state_problems(model, model.config)
    assert not problems and layout is not None
    assert layout.layers == layers and layout.stepwise == frozenset(stepwise)
    assert {(s.kind, s.state_idx) for s in layout.specs if s.layer_idx == layers[0]} == states


def _layers(model) -> StateLayers:
    layout, _ = state_problems(model, model.config)
    cache = StateCache(layout.specs, 3, torch.device("cpu"))
    return StateLayers(layout.modules, cache, stepwise=layout.stepwise, calls=layout.calls)


def _last_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0, -1]


@pytest.mark.parametrize("name", ["rwkv", "xlstm"])
def test_a_packed_step_equals_each_request_alone(name: str) -> None:
    """Two prompts packed in one step (each a fresh span at its slot), then a decode batch of both and a
    continued chunk of a third: every row equals that request's own forward (RWKV's decode batch runs a
    request at a time: its one-token path broadcasts across a batch). The families without attention
    layers, called directly; MiniMax's and RecurrentGemma's attention needs the engine's paged cache
    (conformance/test_parity_hybrid.py runs all four through it)."""
    model = build_hybrid(name)
    layers = _layers(model)
    a, b, c = [5, 9, 13, 17, 21], [7, 11, 3], [30, 31, 32, 33, 34, 35, 36]
    position_ids = torch.tensor([list(range(len(a))) + list(range(len(b))) + list(range(4))])
    with torch.no_grad():
        with layers.step(
            StateTable(None, 0, [(0, len(a), 0, True), (len(a), len(b), 1, True), (8, 4, 2, True)])
        ):
            packed = model(torch.tensor([a + b + c[:4]]), position_ids=position_ids, use_cache=False).logits[
                0
            ]
        torch.testing.assert_close(packed[len(a) - 1], _last_logits(model, a))
        torch.testing.assert_close(packed[len(a) + len(b) - 1], _last_logits(model, b))
        step = StateTable(torch.tensor([0, 1]), 2, [(2, 3, 2, False)])
        position_ids = torch.tensor([[len(a), len(b), 4, 5, 6]])
        with layers.step(step):
            packed = model(
                torch.tensor([[40, 41, *c[4:]]]), position_ids=position_ids, use_cache=False
            ).logits[0]
    torch.testing.assert_close(packed[0], _last_logits(model, [*a, 40]), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(packed[1], _last_logits(model, [*b, 41]), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(packed[4], _last_logits(model, c), rtol=1e-4, atol=1e-4)


def test_recurrent_gemma_steps_never_touch_the_blocks_own_state() -> None:
    """Its states live on the block in transformers; a step runs on copies holding the slots' states, so
    a `generate()` of the same model (another thread beside a running manager) keeps its own: the
    block's attributes are what `generate()` left, before and after a step."""
    model = build_hybrid("recurrent_gemma")
    layers = _layers(model)
    with torch.no_grad():
        model(torch.tensor([[9, 8]]), use_cache=True)  # generate()'s prefill leaves its states on the blocks
        left = {
            i: (m.conv1d_state.clone(), m.rg_lru.recurrent_states.clone()) for i, m in layers.modules.items()
        }
        with layers.step(StateTable(None, 0, [(0, 3, 0, True)])):
            model(torch.tensor([[5, 6, 7]]), position_ids=torch.tensor([[0, 1, 2]]), use_cache=False)
    for i, module in layers.modules.items():
        torch.testing.assert_close(module.conv1d_state, left[i][0], rtol=0, atol=0)
        torch.testing.assert_close(module.rg_lru.recurrent_states, left[i][1], rtol=0, atol=0)
    assert layers.cache.tensors[(0, RECURRENT, 0)][0].any()


def test_a_state_layer_called_on_part_of_the_step_is_an_error() -> None:
    """A model that splits the packed step itself (xLSTM past its `max_inference_chunksize`) would run
    a table's rows against the wrong tokens: refused with the reason, never a silent mismatch."""
    model = build_hybrid("xlstm")
    model.config.max_inference_chunksize = 2
    layers = _layers(model)
    with (
        torch.no_grad(),
        layers.step(StateTable(None, 0, [(0, 4, 0, True)])),
        pytest.raises(InvariantError, match="max_inference_chunksize"),
    ):
        model(torch.tensor([[5, 6, 7, 8]]), use_cache=False)


def test_xlstm_steps_stay_within_its_chunk_limit() -> None:
    """xLSTM runs a forward longer than `max_inference_chunksize` in pieces of its own: the settings lower
    the default step budget to it (and then equals `generate()`, which splits a long prompt the same
    way), and refuse a `max_batch_tokens` asked above it, naming the field."""
    model = build_hybrid("xlstm")
    model.config.max_inference_chunksize = 8
    settings, _ = resolve_settings(model, None, ContinuousBatchingConfig(num_blocks=8))
    assert settings.sizing.max_batch_tokens == 8
    with pytest.raises(ValueError, match="max_batch_tokens=16 exceeds the 8 tokens"):
        resolve_settings(model, None, ContinuousBatchingConfig(max_batch_tokens=16))
    prompts = [[(7 * i + 3) % 250 + 3 for i in range(n)] for n in (21, 5)]
    outputs = model.generate_batch(prompts, greedy_config(6), progress_bar=False)
    expected = [greedy_reference(model, p, 6) for p in prompts]
    check_parity(model, prompts, outputs, expected, "xlstm / max_inference_chunksize=8")
