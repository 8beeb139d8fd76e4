"""A tiny sharpened Llama carrying three LoRA adapters of different ranks (one rsLoRA, one on the head),
their B matrices seeded away from zero, and `generate()`'s tokens on each adapter or on the base model:
the references of the per-request adapter tests (docs/adapters.md)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from transformers import PreTrainedModel

from conformance.common import greedy_config, reference_greedy
from tests.support.models import sharpen_attention, tiny_llama

peft = pytest.importorskip("peft", reason="the adapter tests need peft (the test extra)")

ADAPTER_CONFIGS = {
    "a": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]},
    "b": {"r": 8, "lora_alpha": 4, "target_modules": ["q_proj", "k_proj", "o_proj", "up_proj"]},
    "c": {"r": 2, "lora_alpha": 16, "use_rslora": True, "target_modules": ["v_proj", "gate_proj", "lm_head"]},
}


def adapted_llama(names: Sequence[str] = ("a", "b", "c"), scale: float = 0.3) -> PreTrainedModel:
    """The model with `names` added (transformers' `add_adapter`), each B seeded (scale `scale`)."""
    model = sharpen_attention(tiny_llama())
    for name in names:
        model.add_adapter(
            peft.LoraConfig(init_lora_weights=False, **ADAPTER_CONFIGS[name]), adapter_name=name
        )
    seed_lora_weights(model, scale, seed=3)
    return model.eval()


def seed_lora_weights(model: torch.nn.Module, scale: float, seed: int, marker: str = "lora_B") -> None:
    """Every parameter whose name holds `marker` set to seeded normals times `scale`."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if marker in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale)


def logprobs_on(
    model: PreTrainedModel, prompt: Sequence[int], tokens: Sequence[int], adapter: str | None
) -> list[float]:
    """The log-probabilities of `tokens` after `prompt` on `adapter` (None: the base model), from one plain
    forward: a check finer than the tokens (an adapter's delta lost in one layer may move no argmax)."""
    active = list(model.active_adapters())
    if adapter is None:
        model.disable_adapters()
    else:
        model.set_adapter(adapter)
    try:
        with torch.no_grad():
            logits = model(torch.tensor([[*prompt, *tokens]])).logits[0, len(prompt) - 1 : -1].float()
    finally:
        if adapter is None:
            model.enable_adapters()
        else:
            model.set_adapter(active)
    logprobs = torch.log_softmax(logits, dim=-1)
    return [float(logprobs[i, t]) for i, t in enumerate(tokens)]


def reference_on(
    model: PreTrainedModel, prompt: Sequence[int], adapter: str | None, max_new: int
) -> list[int]:
    """`generate()` after `set_adapter(adapter)`, or with the adapters disabled for None; the model's active
    adapter is put back."""
    active = list(model.active_adapters())
    if adapter is None:
        model.disable_adapters()
        try:
            return reference_greedy(model, prompt, greedy_config(max_new))
        finally:
            model.enable_adapters()
    model.set_adapter(adapter)
    try:
        return reference_greedy(model, prompt, greedy_config(max_new))
    finally:
        model.set_adapter(active)
