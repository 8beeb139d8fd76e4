"""The plugin's footprint on transformers: patched methods, registered backends, install/uninstall."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaForCausalLM, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface
from transformers.models.llama import modeling_llama

import transformers_cb
from tests.support.models import TINY_MODELS, tiny_llama
from tests.support.prompts import prompts_of_lengths
from tests.support.reference import greedy_reference
from transformers_cb import plugin
from transformers_cb.api.generate_batch import generate_batch
from transformers_cb.attention import PAGED_BACKENDS
from transformers_cb.attention.backends.eager import eager_paged_attention_forward
from transformers_cb.attention.backends.sdpa import sdpa_paged_attention_forward
from transformers_cb.runner.model_runner import ModelRunner

MODEL_METHODS = [
    "generate_batch",
    "init_continuous_batching",
    "continuous_batching_context_manager",
    "destroy_cached_continuous_batching_manager",
]
GREEDY = GenerationConfig(max_new_tokens=6, do_sample=False)


@pytest.fixture
def reinstall():
    """Leave the plugin installed whatever the test did."""
    yield
    transformers_cb.install()
    assert transformers_cb.is_installed()


@pytest.fixture(scope="module")
def saved_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    tiny_llama(seed=3).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def sdpa_model(saved_dir):
    return AutoModelForCausalLM.from_pretrained(
        saved_dir, attn_implementation="sdpa", dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def prompts():
    return prompts_of_lengths([5, 11, 3], seed=4)


def load(saved_dir, attn_implementation: str) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(
        saved_dir, attn_implementation=attn_implementation, dtype=torch.float32
    ).eval()


def record_step_attention(monkeypatch) -> list[str]:
    """The model's attention implementation as seen by every continuous batching step."""
    seen: list[str] = []
    original = ModelRunner.run

    def run(self, batch):
        seen.append(self.model.config._attn_implementation)
        return original(self, batch)

    monkeypatch.setattr(ModelRunner, "run", run)
    return seen


def count_calls(monkeypatch, name: str) -> list[int]:
    """Wrap the attention function `name` to count its calls.

    Plain "eager" is not in the registry: Llama passes its module's `eager_attention_forward` as the default.
    """
    calls: list[int] = []
    if name == "eager":
        original = modeling_llama.eager_attention_forward
    else:
        original = AttentionInterface._global_mapping[name]

    def wrapper(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    if name == "eager":
        monkeypatch.setattr(modeling_llama, "eager_attention_forward", wrapper)
    else:
        monkeypatch.setitem(AttentionInterface._global_mapping, name, wrapper)
    return calls


# -- installed state -----------------------------------------------------------------------------


def test_import_installs_model_methods() -> None:
    assert transformers_cb.is_installed()
    assert PreTrainedModel.generate_batch is generate_batch
    assert PreTrainedModel.generate_batch.__module__ == "transformers_cb.api.generate_batch"
    # Ours wins over the built-in ContinuousMixin that model classes inherit from GenerationMixin.
    assert LlamaForCausalLM.generate_batch is generate_batch
    for name in MODEL_METHODS:
        assert getattr(PreTrainedModel, name).__module__.startswith("transformers_cb"), name


def test_paged_backends_are_registered() -> None:
    # The torch backends are registered as they are: their native-only steps are one custom op per layer,
    # inside a compiled graph, and the rest is a compile boundary of its own (attention/paged.py). The flash
    # backends sit behind torch.compiler.disable (their control flow follows each step's layout).
    sdpa, eager = PAGED_BACKENDS["paged|sdpa"], PAGED_BACKENDS["paged|eager"]
    assert sdpa is sdpa_paged_attention_forward
    assert eager is eager_paged_attention_forward
    assert all(
        hasattr(PAGED_BACKENDS[name], "__wrapped__")
        for name in (
            "paged|flash_attention_2",
            "paged|flash_attention_3",
            "paged|kernels-community/flash-attn2",
        )
    )
    assert ALL_ATTENTION_FUNCTIONS.get_interface("paged|sdpa", None) is sdpa
    assert ALL_ATTENTION_FUNCTIONS.get_interface("paged|eager", None) is eager
    assert AttentionInterface._global_mapping["paged|sdpa"] is sdpa
    masks = AttentionMaskInterface._global_mapping
    assert masks["paged|sdpa"] is masks["sdpa"]
    assert masks["paged|eager"] is masks["eager"]
    for name in ("paged|flash_attention_2", "paged|flash_attention_3", "paged|kernels-community/flash-attn2"):
        assert ALL_ATTENTION_FUNCTIONS.get_interface(name, None) is PAGED_BACKENDS[name]
        assert masks[name] is masks["sdpa"]  # outside continuous batching they run SDPA
    # Other names are untouched.
    assert ALL_ATTENTION_FUNCTIONS.get_interface("sdpa", None) is AttentionInterface._global_mapping["sdpa"]


def test_from_pretrained_with_paged_sdpa(saved_dir, sdpa_model, prompts) -> None:
    model = load(saved_dir, "paged|sdpa")
    assert model.config._attn_implementation == "paged|sdpa"
    outputs = model.generate_batch(prompts, GREEDY, progress_bar=False)
    for i, prompt in enumerate(prompts):
        assert outputs[f"req_{i}"].generated_tokens == greedy_reference(sdpa_model, prompt, 6)
    assert model.config._attn_implementation == "paged|sdpa"


def test_set_attn_implementation_to_paged_eager(saved_dir, prompts, monkeypatch) -> None:
    model = load(saved_dir, "paged|sdpa")
    model.set_attn_implementation("paged|eager")
    assert model.config._attn_implementation == "paged|eager"
    seen = record_step_attention(monkeypatch)
    eager_calls = count_calls(monkeypatch, "paged|eager")
    sdpa_calls = count_calls(monkeypatch, "paged|sdpa")
    outputs = model.generate_batch(prompts, GREEDY, progress_bar=False)
    assert set(seen) == {"paged|eager"}
    assert eager_calls and not sdpa_calls
    eager_model = load(saved_dir, "eager")
    for i, prompt in enumerate(prompts):
        assert outputs[f"req_{i}"].generated_tokens == greedy_reference(eager_model, prompt, 6)
    model.set_attn_implementation("sdpa")
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize(("paged", "plain"), [("paged|sdpa", "sdpa"), ("paged|eager", "eager")])
def test_plain_generate_on_a_paged_model(saved_dir, prompts, paged: str, plain: str, monkeypatch) -> None:
    paged_model, plain_model = load(saved_dir, paged), load(saved_dir, plain)
    calls = count_calls(monkeypatch, paged)
    for prompt in prompts:
        assert greedy_reference(paged_model, prompt, 6) == greedy_reference(plain_model, prompt, 6)
    assert calls, f"plain generate() should run through {paged}"
    # Batched, left-padded, with an attention mask.
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kwargs = {"attention_mask": attention_mask, "max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    with torch.inference_mode():
        paged_out = paged_model.generate(input_ids, **kwargs)
        plain_out = plain_model.generate(input_ids, **kwargs)
    assert paged_out.tolist() == plain_out.tolist()
    assert paged_model.config._attn_implementation == paged


@pytest.mark.parametrize(("plain", "paged"), [("sdpa", "paged|sdpa"), ("eager", "paged|eager")])
def test_plain_model_is_switched_only_during_generate_batch(
    saved_dir, prompts, plain: str, paged: str, monkeypatch
) -> None:
    model = load(saved_dir, plain)
    references = [greedy_reference(model, p, 6) for p in prompts]
    seen = record_step_attention(monkeypatch)
    paged_calls = count_calls(monkeypatch, paged)
    plain_calls = count_calls(monkeypatch, plain)
    outputs = model.generate_batch(prompts, GREEDY, progress_bar=False)
    assert seen and set(seen) == {paged}
    assert paged_calls, f"{paged} should run the steps"
    assert not plain_calls, f"{plain} should not run inside generate_batch"
    assert model.config._attn_implementation == plain
    for i, reference in enumerate(references):
        assert outputs[f"req_{i}"].generated_tokens == reference
    # Plain generate() afterwards uses the user's choice again.
    assert [greedy_reference(model, p, 6) for p in prompts] == references
    assert plain_calls
    assert model.config._attn_implementation == plain


def test_attention_is_restored_when_generate_batch_fails(saved_dir, monkeypatch) -> None:
    model = load(saved_dir, "sdpa")

    def boom(self, batch):
        raise KeyboardInterrupt  # not an Exception: escapes the per-step error handling

    monkeypatch.setattr(ModelRunner, "run", boom)
    with pytest.raises(KeyboardInterrupt):
        model.generate_batch([[5, 6, 7]], GREEDY, progress_bar=False)
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("family", sorted(TINY_MODELS))
def test_tiny_model_families_run_paged(family: str, monkeypatch) -> None:
    model = TINY_MODELS[family]()
    assert model.config._attn_implementation == "sdpa"
    seen = record_step_attention(monkeypatch)
    prompts = prompts_of_lengths([4, 9], seed=5)
    outputs = model.generate_batch(
        prompts, GenerationConfig(max_new_tokens=4, do_sample=False), progress_bar=False
    )
    assert set(seen) == {"paged|sdpa"}
    for i, prompt in enumerate(prompts):
        assert outputs[f"req_{i}"].generated_tokens == greedy_reference(model, prompt, 4)


# -- uninstall / install -------------------------------------------------------------------------


def comparable(value):
    """A fresh wrapper closure per install compares by what it wraps."""
    wrapped = getattr(value, "__wrapped__", None)
    return value if wrapped is None else ("wrapper", value.__qualname__, wrapped)


def registry_snapshot() -> dict:
    patched = [*MODEL_METHODS, "_check_and_adjust_attn_implementation"]
    return {
        "attention": dict(AttentionInterface._global_mapping),
        "masks": dict(AttentionMaskInterface._global_mapping),
        "model_attrs": {k: comparable(v) for k, v in vars(PreTrainedModel).items() if k in patched},
        "get_interface": comparable(vars(AttentionInterface).get("get_interface")),
    }


def test_uninstall_restores_transformers(reinstall, saved_dir) -> None:
    installed_check = PreTrainedModel._check_and_adjust_attn_implementation
    installed_get_interface = AttentionInterface.get_interface
    original_check = installed_check.__wrapped__
    original_get_interface = installed_get_interface.__wrapped__

    transformers_cb.uninstall()
    assert not transformers_cb.is_installed()
    for name in MODEL_METHODS:
        assert name not in vars(PreTrainedModel), name
    assert LlamaForCausalLM.generate_batch.__qualname__ == "ContinuousMixin.generate_batch"
    assert LlamaForCausalLM.generate_batch.__module__.startswith("transformers.generation")
    assert PreTrainedModel._check_and_adjust_attn_implementation is original_check
    assert original_check.__module__ == "transformers.modeling_utils"
    assert AttentionInterface.get_interface is original_get_interface
    mapping = AttentionInterface._global_mapping
    assert "paged|sdpa" not in mapping
    assert mapping["paged|eager"] is not PAGED_BACKENDS["paged|eager"]
    assert mapping["paged|eager"].__module__.startswith("transformers.")
    assert not any(key.startswith("paged|") for key in AttentionMaskInterface._global_mapping)
    uninstalled = registry_snapshot()

    transformers_cb.uninstall()  # idempotent
    assert registry_snapshot() == uninstalled

    transformers_cb.install()
    assert transformers_cb.is_installed()
    assert PreTrainedModel.generate_batch is generate_batch
    assert ALL_ATTENTION_FUNCTIONS.get_interface("paged|sdpa", None) is PAGED_BACKENDS["paged|sdpa"]
    assert AttentionInterface._global_mapping["paged|eager"] is PAGED_BACKENDS["paged|eager"]
    installed = registry_snapshot()
    num_saved = len(plugin._saved), len(plugin._saved_registry)
    transformers_cb.install()  # idempotent
    assert registry_snapshot() == installed
    assert (len(plugin._saved), len(plugin._saved_registry)) == num_saved
    # The wrappers wrap the originals, not an earlier wrapper.
    assert PreTrainedModel._check_and_adjust_attn_implementation.__wrapped__ is original_check
    assert AttentionInterface.get_interface.__wrapped__ is original_get_interface

    # A round trip restores exactly the same state.
    transformers_cb.uninstall()
    assert registry_snapshot() == uninstalled
    transformers_cb.install()
    assert registry_snapshot() == installed

    # And it still works after reinstalling.
    model = load(saved_dir, "paged|sdpa")
    assert model.config._attn_implementation == "paged|sdpa"
    outputs = model.generate_batch([[5, 6, 7]], GREEDY, progress_bar=False)
    assert len(outputs["req_0"].generated_tokens) == 6


def test_uninstalled_plugin_leaves_plain_models_working(reinstall, saved_dir, prompts) -> None:
    model = load(saved_dir, "sdpa")
    references = [greedy_reference(model, p, 6) for p in prompts]
    transformers_cb.uninstall()
    assert [greedy_reference(model, p, 6) for p in prompts] == references
    assert model.generate_batch.__func__ is not generate_batch
