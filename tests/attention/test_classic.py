"""The classic families' adapter (attention/classic.py) and the ALiBi slopes (attention/alibi.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.bloom.modeling_bloom import _get_alibi_slopes
from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

from transformers_cb.attention.alibi import alibi_bias, bloom_slopes, mpt_slopes
from transformers_cb.attention.classic import classic_attention, classic_modules, has_classic_attention


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
