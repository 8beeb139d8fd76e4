"""PEFT adapters (issue 47, item 5): a PEFT-wrapped model gives `generate()`'s tokens of the same wrapped
model, with every eligible Linear packed (`TRANSFORMERS_CB_PACKED_LINEAR=all`) and prefix sharing on small
pages, for LoRA, DoRA, LoRA with `modules_to_save` and IA³; across `set_adapter` between calls and an
adapter trained between calls. Attention is sharpened (tests/support/models.py) so that a wrong key moves
the argmax. Each adapter is initialised away from identity, and each test shows it changes the tokens.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conformance.common import check_parity, greedy_config, reference_greedy
from tests.support.models import sharpen_attention, tiny_qwen2
from transformers_cb import ContinuousBatchingConfig
from transformers_cb.runner.products.packed_linear import RULE_ENV, PackRule
from transformers_cb.runner.products.packed_model import packing_settings

peft = pytest.importorskip("peft", reason="the PEFT tests need peft (the test extra installs it)")

MAX_NEW_TOKENS = 10
SYSTEM = list(range(20, 33))  # a shared prefix over several 4-token pages: prefix hits across calls
PROMPTS = [SYSTEM + [40, 41], SYSTEM + [50, 51, 52], [7, 8, 9], SYSTEM + [40, 41, 60, 61, 62]]
ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CB_CONFIG = ContinuousBatchingConfig(page_size=4)


def _lora(**kwargs) -> object:
    return peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **kwargs)


def _perturb(model: nn.Module, marker: str, scale: float) -> None:
    """Move the parameters whose name holds `marker` away from their initial (identity) values."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if marker in name:
                parameter.add_(scale * torch.randn(parameter.shape, generator=generator))


def _adapted(kind: str) -> nn.Module:
    model = peft.get_peft_model(sharpen_attention(tiny_qwen2()), ADAPTERS[kind]())
    if kind == "lora_modules_to_save":
        _perturb(model, "modules_to_save", 0.5)
    if kind == "ia3":
        _perturb(model, "ia3_l", 0.5)
    return model.eval()


ADAPTERS = {
    "lora": lambda: _lora(target_modules=ALL_PROJECTIONS),
    "dora": lambda: _lora(target_modules=["q_proj", "v_proj", "down_proj"], use_dora=True),
    "lora_modules_to_save": lambda: _lora(target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"]),
    "ia3": lambda: peft.IA3Config(
        target_modules=["k_proj", "v_proj", "down_proj"],
        feedforward_modules=["down_proj"],
        init_ia3_weights=False,
    ),
}


@pytest.fixture(autouse=True)
def _pack_every_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(RULE_ENV, "all")  # every eligible Linear packed, from the first row


def _references(model: nn.Module) -> list[list[int]]:
    return [reference_greedy(model, prompt, greedy_config(MAX_NEW_TOKENS)) for prompt in PROMPTS]


def _check(model: nn.Module, context: str) -> list[list[int]]:
    """generate_batch (the engine kept on the model: its prefix cache outlives the call) against generate()
    of the wrapped model as it is now; returns the references."""
    references = _references(model)
    outputs = model.generate_batch(
        PROMPTS,
        generation_config=greedy_config(MAX_NEW_TOKENS),
        continuous_batching_config=CB_CONFIG,
        persistent_manager=True,
        progress_bar=False,
    )
    check_parity(model, PROMPTS, outputs, references, context)
    return references


def _assert_changes_tokens(model: nn.Module, adapted: list[list[int]], context: str) -> None:
    with model.disable_adapter():
        plain = _references(model)
    assert plain != adapted, f"{context}: the adapter changes no token: the test could not fail"


@pytest.mark.parametrize("kind", sorted(ADAPTERS))
def test_an_adapted_model_gives_generates_tokens_with_every_linear_packed(kind: str) -> None:
    model = _adapted(kind)
    references = _check(model, kind)
    _assert_changes_tokens(model, references, kind)
    _check(model, f"{kind}, second call (prefix hits)")


@pytest.mark.parametrize("kind", sorted(ADAPTERS))
def test_an_adapted_linear_is_never_packed_as_its_base_weight_alone(kind: str) -> None:
    """The packer takes plain `nn.Linear`s only: a PEFT layer (its forward adds the adapter) is left
    unpacked, and only its base layer (and LoRA's own A / B Linears) run packed inside its forward."""
    model = _adapted(kind)
    settings = packing_settings(model, PackRule(every_weight=True))
    packed = {id(m) for m, _ in settings.singles} | {id(m) for g, _ in settings.groups for m in g.members}
    wrappers = [m for m in model.modules() if hasattr(m, "base_layer") or hasattr(m, "original_module")]
    assert wrappers, f"{kind}: no PEFT layer found"
    assert not any(id(m) in packed for m in wrappers)
    bases = [m.base_layer for m in wrappers if isinstance(getattr(m, "base_layer", None), nn.Linear)]
    assert bases and all(id(m) in packed for m in bases)


def test_set_adapter_between_calls_never_reuses_the_other_adapters_kv() -> None:
    model = _adapted("lora")
    model.add_adapter("other", _lora(target_modules=["q_proj", "v_proj"]))
    first = _check(model, "adapter default")
    model.set_adapter("other")
    second = _check(model, "adapter other, after set_adapter (the prefix cache holds default's pages)")
    assert first != second, "the two adapters give the same tokens: the test could not fail"
    model.set_adapter("default")
    _check(model, "adapter default again")
    with model.disable_adapter():
        _check(model, "adapters disabled")


def test_set_adapter_inside_a_pause_is_a_new_weight_version() -> None:
    model = _adapted("lora")
    model.add_adapter("other", _lora(target_modules=["q_proj", "v_proj"]))
    manager = model.init_continuous_batching(
        generation_config=greedy_config(MAX_NEW_TOKENS), continuous_batching_config=CB_CONFIG
    )
    manager.start()
    try:
        for version, adapter in enumerate(["default", "other", "default"]):
            with manager.pause():
                model.set_adapter(adapter)
            assert manager.weight_version == version  # the first set_adapter changes nothing
            ids = manager.add_requests(PROMPTS, max_new_tokens=MAX_NEW_TOKENS)
            outputs = {output.request_id: output for output in manager}
            results = {f"req_{i}": outputs[rid] for i, rid in enumerate(ids)}
            check_parity(model, PROMPTS, results, _references(model), f"manager, adapter {adapter}")
    finally:
        manager.stop(hard_stop=True)


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_an_adapter_trained_between_calls_is_seen_by_the_next_call(kind: str) -> None:
    model = _adapted(kind)
    before = _check(model, f"{kind} before training")
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=2.0)
    base_bytes = _frozen_bytes(model)
    for _ in range(3):
        batch = torch.tensor([PROMPTS[0]])
        model.train()
        loss = -model(input_ids=batch, labels=batch).loss  # push away from the prompt: tokens move
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        model.eval()
    after = _check(model, f"{kind} after training")
    assert after != before, f"{kind}: training moved no token: the test could not fail"
    assert _frozen_bytes(model) == base_bytes  # no merge, no copy: the base weights are the same storage


def _frozen_bytes(model: nn.Module) -> list[tuple[int, int]]:
    return [(p.data_ptr(), p._version) for p in model.parameters() if not p.requires_grad]


def test_an_adapter_written_through_data_between_calls_is_seen() -> None:
    """A trainer's wrapper may write the adapter through `.data` (no version bump: TRL's GRPO in bf16); the
    engine kept on the model must not reuse the prefix pages, nor the packs, of the adapter before."""
    model = _adapted("lora")
    before = _check(model, "before the write")
    generator = torch.Generator().manual_seed(5)
    for name, parameter in model.named_parameters():
        if "lora_" in name:
            parameter.data.add_(torch.randn(parameter.shape, generator=generator))
    after = _check(model, "after a write through .data")
    assert after != before, "the write moved no token: the test could not fail"
