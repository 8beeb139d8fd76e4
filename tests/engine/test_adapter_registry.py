"""The engine's adapters by name (engine/weights/adapter_registry.py, docs/adapters.md): a `peft.PeftModel` with
several adapters (LoRA and DoRA) runs each per request as `generate()` after `set_adapter`; what cannot be
split per request (IA³, `modules_to_save`) is refused by name at submission, and runs as the active adapter
when no `adapter=` is given (issue 47's behaviour)."""

from __future__ import annotations

import pytest
import torch

from tests.support.adapters import seed_lora_weights
from tests.support.models import sharpen_attention, tiny_llama
from transformers_cb import ContinuousBatchingConfig
from transformers_cb.conformance_check import greedy_config, reference_greedy
from transformers_cb.engine.weights.adapter_registry import UNSET, AdapterRegistry
from transformers_cb.requests import AdapterChoice

peft = pytest.importorskip("peft", reason="the adapter tests need peft (the test extra installs it)")

MAX_NEW_TOKENS = 6
PROMPTS = [[5, 6, 7, 8, 9], [20, 21, 22], [30, 31, 32, 33, 34, 35, 36], [40, 41, 42, 43]]
CB_CONFIG = ContinuousBatchingConfig(page_size=4, max_batch_tokens=8)


def _lora(**kwargs) -> object:
    return peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **kwargs)


def _peft_model() -> torch.nn.Module:
    model = peft.get_peft_model(sharpen_attention(tiny_llama()), _lora(target_modules=["q_proj", "v_proj"]))
    model.add_adapter("dora", _lora(target_modules=["k_proj", "up_proj"], use_dora=True))
    model.add_adapter("wide", _lora(target_modules=["o_proj", "down_proj", "gate_proj"]))
    seed_lora_weights(model, 0.3, seed=4)
    return model.eval()


def _reference(model, prompt: list[int], adapter: str | None) -> list[int]:
    if adapter is None:
        with model.disable_adapter():
            return reference_greedy(model, prompt, greedy_config(MAX_NEW_TOKENS))
    model.set_adapter(adapter)
    try:
        return reference_greedy(model, prompt, greedy_config(MAX_NEW_TOKENS))
    finally:
        model.set_adapter("default")


def test_a_peft_model_runs_each_of_its_adapters_per_request_dora_included() -> None:
    model = _peft_model()
    adapters = ["dora", None, "wide", "default"]
    references = [_reference(model, p, a) for p, a in zip(PROMPTS, adapters, strict=True)]
    assert len({tuple(r) for r in references}) == 4, "the adapters change no token: the test could not fail"
    outputs = model.generate_batch(
        PROMPTS,
        generation_config=greedy_config(MAX_NEW_TOKENS),
        continuous_batching_config=CB_CONFIG,
        adapter=adapters,
        progress_bar=False,
    )
    assert [o.generated_tokens for o in outputs.values()] == references


def test_what_is_known_and_what_each_choice_is() -> None:
    model = _peft_model()
    registry = AdapterRegistry(model)
    assert {name: info.method for name, info in registry.adapters().items()} == {
        "default": "LoRA",
        "dora": "DoRA",
        "wide": "LoRA",
    }
    assert registry.resolve(UNSET, "r") == AdapterChoice(("default",))
    assert registry.resolve(None, "r") == AdapterChoice(())
    assert registry.resolve("wide", "r") == AdapterChoice(("wide",))
    assert registry.bump("wide") == 1
    assert registry.resolve("wide", "r") == AdapterChoice(("wide",), 1)
    with model.disable_adapter():
        assert registry.resolve(UNSET, "r") == AdapterChoice(())
    with pytest.raises(ValueError, match="r: adapter must be an adapter's name"):
        registry.resolve(3, "r")
    with pytest.raises(
        ValueError, match=r"r: unknown adapter 'x'; the model's adapters: \['default', 'dora', 'wide'\]"
    ):
        registry.resolve("x", "r")


def test_a_model_without_adapters_takes_none_and_refuses_a_name() -> None:
    registry = AdapterRegistry(tiny_llama())
    assert registry.resolve(UNSET, "r") is None
    assert registry.resolve(None, "r") is None
    with pytest.raises(ValueError, match="unknown adapter 'a': the model carries no PEFT adapter"):
        registry.resolve("a", "r")


def test_ia3_and_modules_to_save_are_refused_per_request_by_name_and_run_when_active() -> None:
    model = peft.get_peft_model(sharpen_attention(tiny_llama()), _lora(target_modules=["q_proj"]))
    model.add_adapter("saved", _lora(target_modules=["v_proj"], modules_to_save=["lm_head"]))
    registry = AdapterRegistry(model)
    with pytest.raises(
        ValueError, match=r"adapter 'saved' \(LoRA\) cannot run per request: it uses modules_to_save"
    ):
        registry.resolve("saved", "r")
    ia3 = peft.get_peft_model(
        sharpen_attention(tiny_llama()),
        peft.IA3Config(
            target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"], init_ia3_weights=False
        ),
    )
    with pytest.raises(ValueError, match=r"adapter 'default' \(IA3\) cannot run per request"):
        AdapterRegistry(ia3).resolve("default", "r")
    with pytest.raises(
        ValueError,
        match=r"adapter=None cannot be applied per request: the model applies adapter\(s\) \['default'\]",
    ):
        AdapterRegistry(ia3).resolve(None, "r")
    assert AdapterRegistry(ia3).resolve(UNSET, "r") is None  # its own forwards: the active IA3 adapter
    seed_lora_weights(ia3, 0.5, seed=2, marker="ia3_l")
    ia3.eval()
    outputs = ia3.generate_batch(
        PROMPTS,
        generation_config=greedy_config(MAX_NEW_TOKENS),
        continuous_batching_config=CB_CONFIG,
        progress_bar=False,
    )
    references = [reference_greedy(ia3, p, greedy_config(MAX_NEW_TOKENS)) for p in PROMPTS]
    assert [o.generated_tokens for o in outputs.values()] == references
