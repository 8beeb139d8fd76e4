"""The direct model step (runner/layer_ops/direct_model.py): a Llama-form model's eager steps through its
modules without its two forwards give the forwards' logits bit for bit at every step (float32 and bfloat16,
products packed or plain, chunked prefills and decodes, sharp attention), greedy float32 tokens equal to
`generate()`; a hook on the model or a layer, a layer that leaves the native call mid-step, another family's
forward or the switch send the step through the model's forward."""

from __future__ import annotations

import pytest
import torch

from tests.support.models import sharpen_attention, tiny_llama, tiny_qwen2
from tests.support.prompts import prompts_of_lengths
from tests.support.reference import greedy_reference
from tests.support.step_logits import assert_same_logits, assert_same_runs
from transformers_cb import ContinuousBatchingConfig
from transformers_cb.attention.native.kernel import ensure_native_module
from transformers_cb.runner import model_runner
from transformers_cb.runner.layer_ops import direct_model, native_layers
from transformers_cb.runner.layer_ops.direct_model import DirectModel
from transformers_cb.runner.layer_ops.layer_forms import references, same_function
from transformers_cb.runner.products.packed_linear import RULE_ENV

pytestmark = pytest.mark.skipif(
    ensure_native_module() is None, reason="the native library cannot be built here"
)

PROMPTS = prompts_of_lengths([5, 40, 23, 9], seed=11)
MAX_NEW = 10


def run(
    model, monkeypatch, model_step: bool, prompts=PROMPTS
) -> tuple[list[list[int]], list[torch.Tensor], int]:
    """(tokens, every step's logits, how many steps the direct model step gave) of one greedy run."""
    logits: list[torch.Tensor] = []
    taken = [0]
    real_call, real_logits = model_runner.call_model, DirectModel.logits

    def recording_call(*args, **kwargs) -> torch.Tensor:
        out = real_call(*args, **kwargs)
        logits.append(out.clone())
        return out

    def recording_logits(self, *args):
        out = real_logits(self, *args) if model_step else None
        if out is not None:
            taken[0] += 1
            logits.append(out.clone())
        return out

    monkeypatch.setattr(model_runner, "call_model", recording_call)
    monkeypatch.setattr(DirectModel, "logits", recording_logits)
    try:
        outputs = model.generate_batch(
            prompts,
            max_new_tokens=MAX_NEW,
            continuous_batching_config=ContinuousBatchingConfig(page_size=16, max_batch_tokens=32),
            progress_bar=False,
        )
    finally:
        monkeypatch.setattr(model_runner, "call_model", real_call)
        monkeypatch.setattr(DirectModel, "logits", real_logits)
    return [outputs[f"req_{i}"].generated_tokens for i in range(len(prompts))], logits, taken[0]


def assert_same_steps(model, monkeypatch) -> int:
    return assert_same_runs(run(model, monkeypatch, True), run(model, monkeypatch, False))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packed", ["all", "off"])
def test_direct_model_steps_give_the_forwards_logits_bit_for_bit(
    monkeypatch, dtype: torch.dtype, packed: str
) -> None:
    monkeypatch.setenv(RULE_ENV, "all" if packed == "all" else "0")
    model = sharpen_attention(tiny_llama(seed=3)).to(dtype)
    taken = assert_same_steps(model, monkeypatch)
    assert taken > 10, f"only {taken} steps took the direct model step"


def test_float32_direct_model_run_equals_generate(monkeypatch) -> None:
    model = sharpen_attention(tiny_llama(seed=5))
    tokens, _, taken = run(model, monkeypatch, True)
    assert taken > 10
    for prompt, got in zip(PROMPTS, tokens, strict=True):
        assert got == greedy_reference(model, prompt, MAX_NEW)


@pytest.mark.parametrize("where", ["model", "inner", "layer"])
def test_a_hook_on_what_the_step_skips_sends_it_through_the_forward(monkeypatch, where: str) -> None:
    """A hook on the inner model or a layer runs: the step goes through the forward. The model's own hooks
    never ran (the runner calls its forward, not the module): the step stays direct."""
    model = sharpen_attention(tiny_llama(seed=1))
    want, _, _ = run(model, monkeypatch, False)
    module = {"model": model, "inner": model.model, "layer": model.model.layers[1]}[where]
    seen: list[int] = []
    handle = module.register_forward_hook(lambda *_: seen.append(1))
    try:
        got, _, taken = run(model, monkeypatch, True)
    finally:
        handle.remove()
    assert got == want
    assert (bool(seen), taken == 0) == ((False, False) if where == "model" else (True, True))
    _, _, taken = run(model, monkeypatch, True)  # the hook removed: direct
    assert taken > 0


def test_a_layer_leaving_the_native_call_mid_step_sends_the_step_through_the_forward(monkeypatch) -> None:
    """The first layers wrote their K/V rows before the third declined: the forward writes them again, with the
    same values, and every step's logits are the forward's."""
    model = sharpen_attention(tiny_llama(seed=3))
    want, logits_off, _ = run(model, monkeypatch, False)
    real = direct_model.layer_step
    calls = [0]

    def declining(parts, *args):
        calls[0] += 1
        return None if parts.layer_idx == 1 and calls[0] % 3 == 0 else real(parts, *args)

    monkeypatch.setattr(direct_model, "layer_step", declining)
    got, logits, taken = run(model, monkeypatch, True)
    assert got == want and 0 < taken < len(logits)
    assert_same_logits(logits, logits_off)


def test_other_families_and_the_switch_keep_the_forward(monkeypatch) -> None:
    _, _, taken = run(tiny_qwen2(seed=1), monkeypatch, True)  # Qwen2Model's forward is not LlamaModel's
    assert taken == 0
    monkeypatch.setenv(native_layers.DIRECT_SWITCH, "0")
    _, _, taken = run(tiny_llama(seed=2), monkeypatch, True)
    assert taken == 0


def test_a_causal_lm_forward_is_recognised_by_its_code_not_its_docstring() -> None:
    from transformers.models.llama.modeling_llama import LlamaForCausalLM

    ref = references()
    assert same_function(LlamaForCausalLM.forward, ref.llama_causal_lm, docstrings=False)

    def forward_a(self, x):
        """Example: one model's usage."""
        return x + 1

    def forward_b(self, x):
        """Example: another model's usage."""
        return x + 1

    def forward_c(self, x):
        """Example: one model's usage."""
        return x + 2

    assert not same_function(forward_a, forward_b)
    assert same_function(forward_a, forward_b, docstrings=False)
    assert not same_function(forward_a, forward_c, docstrings=False)
