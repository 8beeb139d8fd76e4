"""The support check refuses up front, naming the model type and what is missing, every model the paged
engine would run wrong: one tiny model (or config) per rule, each from a real transformers class that
breaks it; families that run exactly are still accepted, and the probe leaves the model as it found it."""

from __future__ import annotations

import threading
from unittest import mock

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    BlipForConditionalGeneration,
    GenerationConfig,
    PreTrainedModel,
)

from tests.support.models import FAMILY_CONFIGS, LlamaIgnoringLogitsToKeep, build_tiny_model
from tests.support.reference import greedy_reference
from transformers_cb import ContinuousBatchingConfig
from transformers_cb.attention.families import classic
from transformers_cb.attention.paged import METADATA_KWARG
from transformers_cb.memory.kv_cache import PagedKVCache
from transformers_cb.memory.sizing import ModelShape
from transformers_cb.model_check.model_support import check_model_supported, ignores_logits_to_keep

SMALL = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}


def tiny(model_type: str, **overrides) -> PreTrainedModel:
    """A seeded random `model_type` causal LM (fp32, eval) of its own config class, small."""
    config = AutoConfig.for_model(model_type, **overrides)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def refusal(model_or_config) -> str:
    with pytest.raises(NotImplementedError) as info:
        check_model_supported(model_or_config)
    return str(info.value)


# rule -> (builder, model type named, words naming the missing capability)
MODEL_RULES = {
    # Attention computed inside the class by a family with no adapter in attention/families/classic.py: the piece
    # it misses is named (CPM-Ant's learned bias per relative-position bucket; a BERT-style encoder).
    "a learned relative-position bias": (
        lambda: tiny(
            "cpmant",
            vocab_size=64,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            dim_head=8,
            dim_ff=64,
            prompt_length=4,
        ),
        "cpmant",
        "learned relative-position bias (position_bias_num_buckets=",
    ),
    "an encoder's self-attention": (
        lambda: tiny(
            "megatron-bert",
            vocab_size=64,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
        ),
        "megatron-bert",
        "bidirectional (MegatronBertSelfAttention built with is_decoder=False)",
    ),
    # Attention run in another thread: the step's metadata (kwarg dropped, context variable per thread)
    # cannot reach it, and the probe does not see the calls either.
    "attention outside the forward's thread": (
        lambda: llama_attending_in_another_thread(),
        "llama",
        "its attention does not go through transformers' attention interface",
    ),
    # Differential attention: two attention calls per layer over the same K.
    "two attention calls per layer": (
        lambda: tiny("diffllama", **SMALL, intermediate_size=64, num_key_value_heads=2),
        "diffllama",
        "call attention 2 times per forward",
    ),
    # BERT as a causal LM without is_decoder: every token attends to every other.
    "bidirectional layers": (
        lambda: tiny("bert", **SMALL, intermediate_size=64),
        "bert",
        "bidirectional (is_causal=False)",
    ),
    # RoBERTa numbers positions from padding_idx + 1, whatever position_ids the engine passes.
    "positions numbered another way": (
        lambda: tiny("roberta", **SMALL, intermediate_size=64, is_decoder=True),
        "roberta",
        "numbers positions its own way",
    ),
    # BART's decoder computes arange(row length) itself: every packed sequence but the first is shifted.
    "position_ids ignored": (
        lambda: tiny(
            "bart",
            vocab_size=64,
            d_model=32,
            decoder_layers=2,
            encoder_layers=2,
            decoder_attention_heads=4,
            encoder_attention_heads=4,
            decoder_ffn_dim=64,
            encoder_ffn_dim=64,
        ),
        "bart",
        "ignores `position_ids`",
    ),
    # Doge's dynamic-mask attention adds a learned bias to the logits through the mask.
    "attention bias in the mask": (
        lambda: tiny("doge", **SMALL, intermediate_size=64, num_key_value_heads=2),
        "doge",
        "add a bias of their own to the attention mask",
    ),
}


def llama_attending_in_another_thread() -> PreTrainedModel:
    """Each layer's attention module runs in a thread of its own, without the metadata kwarg (a layer that
    drops the kwargs and parallelises its heads' work, say)."""
    model = tiny("llama", **SMALL, intermediate_size=64, num_key_value_heads=2)
    for layer in model.model.layers:
        forward = layer.self_attn.forward

        def in_a_thread(*args, _forward=forward, **kwargs):
            kwargs.pop(METADATA_KWARG, None)
            result = []

            def target() -> None:
                with torch.inference_mode():
                    result.append(_forward(*args, **kwargs))

            thread = threading.Thread(target=target)
            thread.start()
            thread.join()
            return result[0]

        layer.self_attn.forward = in_a_thread
    return model


def llama_ignoring_logits_to_keep() -> PreTrainedModel:
    config = AutoConfig.for_model("llama", **SMALL, intermediate_size=64, num_key_value_heads=2)
    torch.manual_seed(0)
    return LlamaIgnoringLogitsToKeep(config).eval()


def llama_with_a_window_it_does_not_apply() -> PreTrainedModel:
    """A config carrying `sliding_window` for a class whose layers attend without one (Moshi's case):
    generate()'s cache, built from the config, keeps only the window while the mask does not apply it."""
    model = tiny("llama", **SMALL, intermediate_size=64, num_key_value_heads=2)
    model.config.sliding_window = 8
    return model


MODEL_RULES["a window the layers do not apply"] = (
    llama_with_a_window_it_does_not_apply,
    "llama",
    "layer 0 applies no window (a plain causal mask) while generate()'s DynamicCache keeps a 8-token window",
)

CONFIG_RULES = {
    # A per-layer attribute other than the head shape (here the MLP width) is not read per layer yet.
    "per-layer attributes": (
        lambda: AutoConfig.for_model(
            "gemma4_text", num_hidden_layers=6, per_layer_config={0: {"intermediate_size": 64}}
        ),
        "gemma4_text",
        "per-layer attributes ['intermediate_size']",
    ),
    # An ALiBi flag on a family without an adapter passing its slopes (Falcon's, Bloom's and MPT's run).
    "ALiBi": (lambda: AutoConfig.for_model("gpt_neox", alibi=True), "gpt_neox", "ALiBi"),
    "cross-attention": (
        lambda: AutoConfig.for_model("bert", is_decoder=True, add_cross_attention=True),
        "bert",
        "cross-attention",
    ),
}


@pytest.mark.parametrize("rule", sorted(MODEL_RULES))
def test_model_refused_naming_type_and_capability(rule: str) -> None:
    build, model_type, capability = MODEL_RULES[rule]
    message = refusal(build())
    assert f"model_type={model_type!r}" in message
    assert capability in message


@pytest.mark.parametrize("rule", sorted(CONFIG_RULES))
def test_config_refused_naming_type_and_capability(rule: str) -> None:
    build, model_type, capability = CONFIG_RULES[rule]
    message = refusal(build())
    assert f"model_type={model_type!r}" in message
    assert capability in message


def test_per_layer_config_is_refused_before_any_sizing() -> None:
    """Reading a per-layer attribute globally raises transformers' AmbiguousGlobalPerLayerAttributeError:
    for one the engine does not read per layer (the MLP width), the refusal comes first, and
    generate_batch allocates nothing."""
    config = AutoConfig.for_model(
        "gemma4_text",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=64,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        per_layer_config={1: {"head_dim": 16}},
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    # Gemma 4's modules read only the head shape per layer: a per-layer MLP width is set after building.
    model.config.per_layer_config = {1: {"head_dim": 16, "intermediate_size": 32}}
    with pytest.raises(RuntimeError, match="per-layer attribute"):
        ModelShape.from_config(model.config)
    with (
        mock.patch.object(PagedKVCache, "__init__", side_effect=AssertionError("allocated")) as cache_init,
        pytest.raises(
            NotImplementedError,
            match="model_type='gemma4_text': per-layer attributes \\['intermediate_size'\\]",
        ),
    ):
        model.generate_batch([[3, 4, 5]], GenerationConfig(max_new_tokens=2), progress_bar=False)
    cache_init.assert_not_called()


def test_composite_model_names_outer_and_text_type() -> None:
    """A vision-language model's refusal names its text model and the composite it belongs to."""
    config = AutoConfig.for_model("paligemma")
    message = refusal(config)
    assert "model_type='gemma' (the text model of 'paligemma')" in message


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_exact_families_are_accepted(family: str) -> None:
    """The parity suite's families (full, sliding, hybrid, softcaps, sinks, MoE) all pass the check."""
    check_model_supported(build_tiny_model(family))


def test_per_layer_head_shapes_are_accepted() -> None:
    """Gemma 4's head_dim / KV heads per layer kind: each shape is its own KV group, so the model runs; the
    probe checks each layer's K/V against that layer's own shape (here without KV-shared layers)."""
    check_model_supported(build_tiny_model("gemma4", num_kv_shared_layers=0))


def test_kv_shared_layers_are_accepted() -> None:
    """Gemma 3n's KV-shared layers attend through the interface with the producing layer's K/V: each
    shared layer caches that K/V under its own index, which is exact (the coverage matrix runs it)."""
    model = tiny(
        "gemma3n_text",
        **{**SMALL, "num_hidden_layers": 3},
        intermediate_size=64,
        num_key_value_heads=2,
        head_dim=8,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=64,
        num_kv_shared_layers=1,
        laurel_rank=4,
        altup_num_inputs=2,
        activation_sparsity_pattern=[0.0, 0.0, 0.0],
        layer_types=["sliding_attention", "full_attention", "full_attention"],
        sliding_window=8,
    )
    check_model_supported(model)


def test_the_probe_leaves_the_model_as_it_found_it() -> None:
    """No forward hook fires (it is a check, not a generation step), and the attention implementation
    and the training mode are restored."""
    model = tiny("llama", **SMALL, intermediate_size=64, num_key_value_heads=2)
    model.train()
    calls = []
    handle = model.register_forward_pre_hook(lambda module, args: calls.append(1))
    before = model.config._attn_implementation
    check_model_supported(model)
    handle.remove()
    assert calls == []
    assert model.training
    assert model.config._attn_implementation == before


def test_a_config_edited_after_a_check_is_probed_again() -> None:
    model = tiny("llama", **SMALL, intermediate_size=64, num_key_value_heads=2)
    check_model_supported(model)
    model.config.sliding_window = 8  # now the cache would keep windows the layers do not apply
    assert "applies no window" in refusal(model)


# Decoder layers that call their attention module without the forward's **kwargs: the step's metadata
# reaches the paged glue through the runner's context variable instead.
KWARG_DROPPING = {
    "stablelm": lambda: tiny("stablelm", **SMALL, intermediate_size=64, num_key_value_heads=2),
    "nemotron": lambda: tiny("nemotron", **SMALL, intermediate_size=64, head_dim=8, num_key_value_heads=4),
}


@pytest.mark.parametrize("model_type", sorted(KWARG_DROPPING))
def test_layers_that_drop_the_kwargs_run_exactly(model_type: str) -> None:
    model = KWARG_DROPPING[model_type]()
    check_model_supported(model)
    prompts = [[5, 9, 11, 3, 7, 21, 30, 2, 8], [4, 6], [13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53]]
    config = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=None)
    cb = ContinuousBatchingConfig(page_size=4, max_batch_tokens=8)  # chunked prefill, mixed steps
    outputs = model.generate_batch(prompts, config, cb, progress_bar=False)
    for i, prompt in enumerate(prompts):
        assert outputs[f"req_{i}"].generated_tokens == greedy_reference(model, prompt, 6)


def test_a_forward_ignoring_logits_to_keep_has_its_rows_selected() -> None:
    """Accepted (the runner selects the rows): greedy tokens equal generate(), and the prompt logprobs
    (every token of the step kept, so the row count alone cannot tell) equal a plain forward's."""
    model = llama_ignoring_logits_to_keep()
    check_model_supported(model)
    assert ignores_logits_to_keep(model)
    plain = tiny("llama", **SMALL, intermediate_size=64, num_key_value_heads=2)
    check_model_supported(plain)
    assert not ignores_logits_to_keep(plain)
    prompts = [[5, 9, 11, 3, 7, 21, 30, 2, 8], [4, 6, 12]]
    config = GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=None)
    outputs = model.generate_batch(prompts, config, progress_bar=False, prompt_logprobs=True)
    for i, prompt in enumerate(prompts):
        out = outputs[f"req_{i}"]
        assert out.generated_tokens == greedy_reference(model, prompt, 5)
        with torch.no_grad():
            logprobs = plain(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
        expected = [logprobs[p - 1, prompt[p]].item() for p in range(1, len(prompt))]
        assert out.prompt_logprobs[1:] == pytest.approx(expected, abs=1e-4)


def test_a_class_computing_attention_itself_without_an_adapter_is_refused(monkeypatch) -> None:
    """Bloom without its adapter (attention/families/classic.py) never reaches the attention interface."""
    monkeypatch.delitem(classic.FAMILIES, "modeling_bloom.BloomAttention")
    message = refusal(tiny("bloom", vocab_size=64, hidden_size=32, n_layer=2, n_head=4))
    assert "model_type='bloom'" in message and "`_supports_attention_backend` is False" in message


def test_a_classic_family_whose_forward_needs_an_image_is_refused_for_that() -> None:
    """BLIP's decoder runs through its adapter, but BlipForConditionalGeneration's forward asks for
    `pixel_values` (its decoder cross-attends to the image): the probe's error is the reason, not the class."""
    config = AutoConfig.for_model(
        "blip",
        text_config={"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 64},
        vision_config={"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4, "image_size": 32},
    )
    torch.manual_seed(0)
    model = BlipForConditionalGeneration(config).eval()
    message = refusal(model)
    assert "a forward on token ids alone fails" in message and "pixel_values" in message


def test_falcon_alibi_and_git_are_supported() -> None:
    check_model_supported(
        tiny("falcon", vocab_size=64, hidden_size=48, num_hidden_layers=2, num_attention_heads=6, alibi=True)
    )
    check_model_supported(
        tiny(
            "git",
            vocab_size=64,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
        )
    )


def test_mpt_under_paged_sdpa_is_supported_on_first_sight() -> None:
    """MPT's own forward under `paged|sdpa` builds SDPA's mask, which is None where `is_causal` would do, and
    calls `.to(torch.bool)` on it: the probe's plain forward takes the eager mask there instead of refusing
    the model (the refusal showed only when no `paged|eager` check of the class had run before)."""
    from transformers import MptConfig, MptForCausalLM

    from transformers_cb.model_check.model_support import check_model_supported

    config = MptConfig(d_model=48, n_heads=6, n_layers=2, max_seq_len=128, expansion_ratio=2, vocab_size=300)
    torch.manual_seed(0)
    model = MptForCausalLM(config).eval()
    model.config._attn_implementation = "paged|sdpa"
    check_model_supported(model)  # raised NotImplementedError ("a forward on token ids alone fails")
    assert model.config._attn_implementation == "paged|sdpa"
