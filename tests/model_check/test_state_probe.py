"""model_check/state_probe.py: the state layers a model has, their states' shapes, and which ones continue a
prefill chunk one token at a time (their multi-token path restarts from a zero state); the support check's
verdicts on the state families (tests/support/hybrids.py)."""

from __future__ import annotations

import pytest
import torch

from tests.support.hybrids import build_hybrid
from transformers_cb import ContinuousBatchingConfig
from transformers_cb.engine.settings import resolve_settings
from transformers_cb.memory.state_cache import CONV, RECURRENT
from transformers_cb.model_check import state_probe
from transformers_cb.model_check.model_support import check_model_supported
from transformers_cb.model_check.state_probe import state_problems


@pytest.mark.parametrize(
    ("name", "state_layers", "stepwise"),
    [
        ("qwen3_5", (0, 2), ()),  # gated delta rule: its chunked path takes the initial state
        ("mamba2", (0, 1), ()),  # SSD: its chunked scan takes the initial state
        ("mamba", (0, 1), (0, 1)),  # selective scan from zero whatever the cache holds
        ("jamba", (0, 2), (0, 2)),
        ("lfm2", (0, 2), ()),  # short convolution only
    ],
)
def test_state_layers_and_stepwise_continuation(name: str, state_layers: tuple, stepwise: tuple) -> None:
    model = build_hybrid(name)
    layout, problems = state_problems(model, model.config)
    assert not problems and layout is not None
    assert layout.layers == state_layers
    assert layout.stepwise == frozenset(stepwise)
    kinds = {(spec.layer_idx, spec.kind) for spec in layout.specs}
    assert {layer for layer, _ in kinds} == set(state_layers)
    assert all((layer, CONV) in kinds for layer in state_layers)
    assert ((state_layers[0], RECURRENT) in kinds) == (name != "lfm2")
    assert layout.bytes_per_slot > 0


def test_stepwise_is_learned_in_float32_for_a_bf16_model() -> None:
    """In bfloat16 a restart from zero hides under rounding; the check runs on a float32 copy, so the
    verdict is the same and the model's own weights keep their dtype."""
    model = build_hybrid("mamba", dtype=torch.bfloat16)
    layout, problems = state_problems(model, model.config)
    assert not problems and layout.stepwise == frozenset({0, 1})
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_a_layer_that_continues_no_state_is_refused(monkeypatch) -> None:
    """Neither a whole continued chunk nor a token at a time gives the whole sequence's output: refused,
    naming the layer (a silent mismatch is never the outcome)."""
    model = build_hybrid("qwen3_5")
    monkeypatch.setattr(state_probe, "continuation_gap", lambda *args, **kwargs: 1.0)
    layout, problems = state_problems(model, model.config)
    assert layout is None
    assert problems and "does not continue a request's state across prefill chunks" in problems[0]


def test_pure_state_space_model_has_no_kv_group() -> None:
    model = build_hybrid("mamba2")
    check_model_supported(model)
    settings, _ = resolve_settings(model, None, ContinuousBatchingConfig(num_blocks=8))
    assert settings.cache.kv_groups == () and settings.cache.group_pages == ()
    assert settings.states is not None and settings.sizing.num_state_slots >= 1


@pytest.mark.parametrize(
    ("name", "reason"),
    [("zamba2", "shared attention block")],
)
def test_families_that_cannot_run_exactly_are_refused(name: str, reason: str) -> None:
    with pytest.raises(NotImplementedError, match=rf"model_type='{name}'.*{reason}"):
        check_model_supported(build_hybrid(name))
