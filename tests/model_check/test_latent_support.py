"""The support check on multi-latent attention models: accepted when every KV layer's module decompresses
its latent the way attention/families/latent.py absorbs it; refused, naming the layer and what is missing, when a
layer has no such module or decompresses otherwise; DeepSeek sparse attention accepted where its indexer
can be handed one request at a time, refused by name where not (GLM-5-next's pooled indexer) or where its
latent rows differ per layer (Mistral Large 4's layers without rotary keys); flash backends refused (their
kernels do not read latent pages)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tests.support import flash_double
from transformers_cb.attention.families.sparse_index import indexer_problem
from transformers_cb.attention.selection import check_flash_backend, paged_implementation_for
from transformers_cb.kv.layer_groups import kv_groups_from_config
from transformers_cb.model_check.model_support import check_model_supported

SHAPE = {
    "vocab_size": 64,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 8,
    "v_head_dim": 6,
    "intermediate_size": 32,
}


MOE = {
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "moe_intermediate_size": 16,
    "first_k_dense_replace": 1,
}


def tiny(model_type: str = "deepseek_v2", **overrides):
    moe = MOE if model_type.startswith("deepseek") else {}
    config = AutoConfig.for_model(model_type, **{**SHAPE, **moe, **overrides})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("model_type", ["deepseek_v2", "minicpm3"])
def test_multi_latent_models_are_accepted(model_type: str) -> None:
    check_model_supported(tiny(model_type))


def test_a_layer_without_a_latent_module_is_refused() -> None:
    model = tiny()
    del model.model.layers[1].self_attn.kv_b_proj
    model.model.layers[1].self_attn.kv_b_proj = torch.nn.Identity()  # not what expand_kv needs
    with pytest.raises(
        NotImplementedError, match=r"model_type='deepseek_v2'.*layer 1: .*kv_b_proj is not a Linear"
    ):
        check_model_supported(model)


def test_a_module_decompressing_otherwise_is_refused() -> None:
    model = tiny()
    attention = model.model.layers[0].self_attn
    original = type(attention).expand_kv

    class Swapped(type(attention)):  # V rows before K rows: what the absorbed attention would misread
        def expand_kv(self, kv_nope, k_rot):
            return original(self, kv_nope * 2, k_rot)

    attention.__class__ = Swapped
    with pytest.raises(
        NotImplementedError, match=r"layer 0: Swapped.expand_kv decompresses its latent otherwise"
    ):
        check_model_supported(model)


def test_deepseek_sparse_attention_is_accepted_with_its_indexer_keys_in_the_pages() -> None:
    config = AutoConfig.for_model("glm_moe_dsa", num_hidden_layers=1)
    check_model_supported(config)
    (group,) = kv_groups_from_config(config)
    assert group.latent is not None and group.index_dim == config.index_head_dim


def test_an_indexer_without_the_arguments_the_pass_through_hands_is_refused() -> None:
    class Pooled(torch.nn.Module):
        index_topk = 4
        layer_idx = 0
        index_kpool = 4

        def forward(self, hidden_states, q_resid, position_embeddings, attention_mask, past_key_values=None):
            raise AssertionError("never called")

    assert "selects pools of index_kpool keys" in str(indexer_problem(Pooled()))

    class Positional(torch.nn.Module):
        index_topk = 4
        layer_idx = 0

        def forward(self, hidden_states, q_resid, mask, cache=None):
            raise AssertionError("never called")

    assert "takes no ['attention_mask', 'past_key_values']" in str(indexer_problem(Positional()))


def test_flash_backends_are_refused_and_never_switched_to() -> None:
    model = tiny()
    model._supports_flash_attn = True
    with flash_double.injected(fa2=True, fa3=True):
        with pytest.raises(ValueError, match="multi-latent attention"):
            check_flash_backend(model, "paged|flash_attention_2")
        auto = paged_implementation_for("sdpa", model, auto_switch_to_flash=True, device_type="cuda")
    assert auto == "paged|sdpa"
