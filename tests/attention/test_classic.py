"""The classic families' adapter (attention/families/classic.py) and the ALiBi slopes (attention/families/alibi.py)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, BlipTextLMHeadModel
from transformers.models.bloom.modeling_bloom import _get_alibi_slopes
from transformers.models.falcon.modeling_falcon import build_alibi_tensor as falcon_alibi_tensor
from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

from transformers_cb.attention.backends.eager import eager_attend
from transformers_cb.attention.backends.sdpa import sdpa_attend
from transformers_cb.attention.families.alibi import (
    FALCON_FORM,
    RELATIVE,
    alibi_bias,
    bloom_slopes,
    mpt_slopes,
)
from transformers_cb.attention.families.classic import (
    classic_attention,
    classic_modules,
    has_classic_attention,
)
from transformers_cb.attention.reference import reference_paged_attention


@pytest.mark.parametrize("heads", range(1, 18))
def test_bloom_slopes_are_bloom_s(heads: int) -> None:
    assert torch.equal(bloom_slopes(heads), _get_alibi_slopes(heads, torch.device("cpu")))


@pytest.mark.parametrize("bias_max", [8, 4])
@pytest.mark.parametrize("heads", range(1, 18))
def test_mpt_slopes_are_mpt_s(heads: int, bias_max: int) -> None:
    """MPT's tensor is `slope * (key_pos - (L - 1))`: its last key's bias is 0 and the one before is -slope."""
    tensor = build_mpt_alibi_tensor(heads, 4, alibi_bias_max=bias_max)  # [H, 1, 4]
    assert torch.equal(-tensor[:, 0, -2], mpt_slopes(heads, bias_max))


def test_alibi_bias_is_the_distance_to_the_query_s_own_key() -> None:
    slopes = torch.tensor([0.5, 0.25])
    causal = alibi_bias(slopes, None, 2, 3, torch.device("cpu"))  # queries are keys 1 and 2
    assert torch.equal(causal[0, 0], torch.tensor([[-0.5, 0.0, 0.5], [-1.0, -0.5, 0.0]]))
    padded = torch.tensor([[True, True, False], [True, True, True]]).view(2, 1, 1, 3)  # a decode group's rows
    bias = alibi_bias(slopes, padded, 1, 3, torch.device("cpu"))
    assert torch.equal(bias[:, 1, 0], torch.tensor([[-0.25, 0.0, 0.25], [-0.5, -0.25, 0.0]]))


def _tiny(model_type: str, **overrides):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(
        AutoConfig.for_model(model_type, vocab_size=64, **overrides)
    ).eval()


def _record(calls: list):
    def attention(module, query, key, value, mask, scaling=None, dropout=0.0, **kwargs):
        calls.append((module.layer_idx, tuple(query.shape), tuple(key.shape), scaling, kwargs))
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scaling
        )
        return out.transpose(1, 2), None

    return attention


def test_the_adapter_is_installed_for_the_block_only() -> None:
    """Inside: every attention module runs the given function (with its index, scaling and slopes); outside,
    nothing of the adapter is left (instance forwards, borrowed indices, model-level patches)."""
    model = _tiny("bloom", hidden_size=48, n_layer=2, n_head=3)
    ids = torch.tensor([[5, 6, 7, 8]])
    before = model(ids).logits
    calls: list = []
    with classic_attention(model, _record(calls)):
        model(ids)
        assert all("forward" in m.__dict__ for m, _ in classic_modules(model))
    assert [c[0] for c in calls] == [0, 1]
    layer, q_shape, k_shape, scaling, kwargs = calls[0]
    assert q_shape == k_shape == (1, 3, 4, 16) and scaling == pytest.approx(16**-0.5)
    assert torch.equal(kwargs["alibi_slopes"], bloom_slopes(3))
    assert not any("forward" in m.__dict__ for m, _ in classic_modules(model))
    assert "build_alibi_tensor" not in model.transformer.__dict__
    assert torch.equal(model(ids).logits, before)


def test_modules_without_an_index_borrow_one_for_the_block() -> None:
    model = _tiny("openai-gpt", n_embd=32, n_layer=2, n_head=4, n_positions=32)
    calls: list = []
    with classic_attention(model, _record(calls)):
        model(torch.tensor([[5, 6, 7]]))
    assert [c[0] for c in calls] == [0, 1]
    assert not any(hasattr(m, "layer_idx") for m, _ in classic_modules(model))


def test_gpt_neo_local_layers_pass_their_window() -> None:
    model = _tiny(
        "gpt_neo",
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        attention_types=[[["global", "local"], 1]],
        window_size=3,
    )
    calls: list = []
    with classic_attention(model, _record(calls)):
        model(torch.tensor([[5, 6, 7]]))
    assert [c[4].get("sliding_window") for c in calls] == [None, 3]
    assert [c[3] for c in calls] == [1.0, 1.0]  # GPT-Neo does not scale its logits


def test_a_nested_entry_leaves_the_modules_to_the_outer_one() -> None:
    model = _tiny("gptj", n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=32)
    outer: list = []
    inner: list = []
    with classic_attention(model, _record(outer)):
        with classic_attention(model, _record(inner)):
            model(torch.tensor([[5, 6, 7]]))
        assert all("forward" in m.__dict__ for m, _ in classic_modules(model))
    assert len(outer) == 2 and not inner


def test_models_of_the_attention_interface_are_not_adapted() -> None:
    assert not has_classic_attention(
        _tiny("llama", hidden_size=32, num_hidden_layers=1, num_attention_heads=4)
    )


# -- Falcon's form of the bias (alibi.AlibiForm) ------------------------------------------------------------
def _falcon_bias(heads: int, kv_len: int, head_dim: int) -> torch.Tensor:
    """Falcon's own additive bias `[H, L]` as its model adds it to the scaled logits (float32 model)."""
    alibi = falcon_alibi_tensor(torch.ones(1, kv_len, dtype=torch.long), heads, torch.float32)  # [H, 1, L]
    return alibi[:, 0] / math.sqrt(head_dim)


@pytest.mark.parametrize("heads", [4, 6])
def test_falcon_form_is_falcon_s_bias(heads: int) -> None:
    """Bitwise Falcon's: bfloat16 slopes times absolute positions, rounded to bfloat16, then scaled (past
    position 256 the rounding is no longer shift-invariant: the relative form differs there)."""
    kv_len, q_len, head_dim = 700, 3, 8
    bias = alibi_bias(
        bloom_slopes(heads), None, q_len, kv_len, torch.device("cpu"), FALCON_FORM, head_dim**-0.5
    )
    expected = _falcon_bias(heads, kv_len, head_dim)
    assert bias.shape == (1, heads, q_len, kv_len)
    for row in range(q_len):
        assert torch.equal(bias[0, :, row], expected)
    relative = alibi_bias(bloom_slopes(heads), None, q_len, kv_len, torch.device("cpu"))[0, :, -1]
    shifted = (
        relative * head_dim**-0.5 + expected[:, -1:]
    )  # the relative form, row-shifted to agree at the end
    assert not torch.allclose(shifted, expected, rtol=0, atol=1e-6)


def test_falcon_form_reads_absolute_positions_under_a_padded_decode_mask() -> None:
    padded = torch.tensor([[True, True, False], [True, True, True]]).view(2, 1, 1, 3)
    bias = alibi_bias(torch.tensor([0.3]), padded, 1, 3, torch.device("cpu"), FALCON_FORM, 0.5)
    per_key = (torch.tensor([0.3]).bfloat16() * torch.arange(3)).bfloat16().float() / 2.0
    assert (
        bias.shape == (2, 1, 1, 3)
        and torch.equal(bias[0, 0, 0], per_key)
        and torch.equal(bias[1, 0, 0], per_key)
    )


def test_an_absolute_form_is_refused_on_a_windowed_layer() -> None:
    FALCON_FORM.check_layer("layer 0", None)
    RELATIVE.check_layer("layer 0", 4)
    with pytest.raises(NotImplementedError, match="layer 0: .*sliding-window"):
        FALCON_FORM.check_layer("layer 0", 4)


def test_falcon_alibi_passes_its_slopes_and_form_and_restores_the_model_flag() -> None:
    model = _tiny("falcon", hidden_size=48, num_hidden_layers=2, num_attention_heads=6, alibi=True)
    ids = torch.tensor([[5, 6, 7, 8]])
    before = model(ids).logits
    calls: list = []
    with classic_attention(model, _record(calls)):
        assert model.transformer.use_alibi is False  # its model-level tensor is not built for the run
        model(ids)
    assert model.transformer.use_alibi is True
    kwargs = calls[0][4]
    assert torch.equal(kwargs["alibi_slopes"], bloom_slopes(6)) and kwargs["alibi_form"] is FALCON_FORM
    assert torch.equal(model(ids).logits, before)


def test_falcon_alibi_through_the_adapter_is_falcon_s_forward() -> None:
    """The adapted forward with the eager kernel (Falcon's form) gives the model's own (SDPA) logits."""
    model = _tiny("falcon", hidden_size=48, num_hidden_layers=2, num_attention_heads=6, alibi=True)
    ids = torch.tensor([list(range(3, 40))])
    expected = model(ids).logits

    def eager(module, query, key, value, mask, scaling=None, dropout=0.0, **kwargs):
        out = eager_attend(
            query, key, value, None, True, scaling, None, None, kwargs["alibi_slopes"], kwargs["alibi_form"]
        )
        return out.transpose(1, 2), None

    with classic_attention(model, eager):
        adapted = model(ids).logits
    torch.testing.assert_close(adapted, expected, rtol=1e-5, atol=1e-5)


def test_git_and_blip_text_are_adapted_and_exact() -> None:
    """GIT's and BLIP's decoder's BERT-style self-attention through the adapter: the model's own logits."""
    git = _tiny("git", hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    blip = BlipTextLMHeadModel(
        AutoConfig.for_model(
            "blip_text_model", vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4
        )
    ).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    for model in (git, blip):
        expected = model(ids).logits
        calls: list = []
        with classic_attention(model, _record(calls)):
            adapted = model(ids).logits
        assert [c[0] for c in calls] == [0, 1] and calls[0][3] == pytest.approx(8**-0.5)
        torch.testing.assert_close(adapted, expected, rtol=1e-5, atol=1e-5)


def test_the_kernels_and_the_oracle_add_falcon_s_form_alike() -> None:
    """Eager, SDPA and the reference oracle give one result under Falcon's form, and another than under the
    relative form (a context past 256 positions, where the bfloat16 products stop being shift-invariant)."""
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, q_len, kv_len, dim, page = 6, 2, 3, 300, 8, 4
    query = torch.randn(1, heads, q_len, dim, generator=gen)
    key = torch.randn(1, kv_heads, kv_len, dim, generator=gen)
    value = torch.randn(1, kv_heads, kv_len, dim, generator=gen)
    slopes, scale = bloom_slopes(heads), dim**-0.5
    eager = eager_attend(query, key, value, None, True, scale, None, None, slopes, FALCON_FORM)
    sdpa = sdpa_attend(query, key, value, None, True, scale, None, None, slopes, FALCON_FORM)
    block_table = torch.arange(kv_len // page, dtype=torch.int32).view(1, -1)
    oracle = reference_paged_attention(
        query[0].transpose(0, 1),
        key[0].transpose(0, 1).contiguous(),
        value[0].transpose(0, 1).contiguous(),
        torch.tensor([0, q_len]),
        torch.tensor([kv_len]),
        block_table,
        page,
        scale,
        slopes=slopes,
        alibi_form=FALCON_FORM,
    )
    torch.testing.assert_close(eager, sdpa, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(eager[0].transpose(0, 1), oracle, rtol=1e-5, atol=1e-6)
    relative = eager_attend(query, key, value, None, True, scale, None, None, slopes * scale)
    assert not torch.allclose(eager, relative, rtol=1e-5, atol=1e-6)
