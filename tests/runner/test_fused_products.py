"""Fused q/k/v and gate/up products (`runner/products/fused_products.py`): the groups found, outputs equal to the
unfused packed path, fewer products, a member called on another input or after a weight update still
exact, and greedy parity with `generate()`."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.support.models import tiny_llama
from tests.support.prompts import prompts_of_lengths
from tests.support.reference import greedy_reference
from transformers_cb import ContinuousBatchingConfig
from transformers_cb.runner.products import packed_linear as packed_linear_module
from transformers_cb.runner.products.fused_products import find_groups
from transformers_cb.runner.products.packed_linear import FUSED_ENV, PACKS, RULE_ENV
from transformers_cb.runner.products.packed_model import is_packable, packed_linears

pytestmark = pytest.mark.skipif(
    packed_linear_module.unsupported_reason(torch.float32, "cpu") is not None,
    reason="packed oneDNN products need x86 with oneDNN",
)


@pytest.fixture(autouse=True)
def every_weight(monkeypatch):
    monkeypatch.setenv(RULE_ENV, "all")  # the tiny model's weights are below the fp32 rule's sizes
    monkeypatch.delenv(FUSED_ENV, raising=False)


def count_products(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = torch.ops.mkldnn._linear_pointwise

    def counting(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", counting)
    return calls


def test_groups_of_a_llama_layer() -> None:
    model = tiny_llama()
    groups = find_groups(model, is_packable, lambda first: PACKS.new_handle())
    layers = model.config.num_hidden_layers
    names = {tuple(type(m).__name__ for m in g.members) for g in groups}
    assert len(groups) == 2 * layers and names == {("Linear",) * 3, ("Linear",) * 2}
    attention = model.model.layers[0].self_attn
    assert any(g.members == (attention.q_proj, attention.k_proj, attention.v_proj) for g in groups)
    for group in groups:
        PACKS.drop(group.handle)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_equals_unfused_and_runs_fewer_products(dtype, monkeypatch) -> None:
    model = tiny_llama().to(dtype)
    ids = torch.randint(3, model.config.vocab_size, (1, 23), generator=torch.Generator().manual_seed(0))
    calls = count_products(monkeypatch)
    # oneDNN's calls are counted: a few bf16 rows would take the small-row product (small_rows.py) instead
    monkeypatch.setenv("TRANSFORMERS_CB_SMALL_ROW_PRODUCTS", "0")
    with torch.inference_mode():
        monkeypatch.setenv(FUSED_ENV, "0")
        with packed_linears(model, True):
            unfused = model(ids).logits
        unfused_calls = len(calls)
        calls.clear()
        monkeypatch.setenv(FUSED_ENV, "1")
        with packed_linears(model, True):
            fused = model(ids).logits
    layers = model.config.num_hidden_layers
    assert unfused_calls == 7 * layers + 1 and len(calls) == 4 * layers + 1
    torch.testing.assert_close(fused, unfused, rtol=0, atol=0)
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_a_member_on_another_input_or_a_changed_weight_is_exact() -> None:
    model = tiny_llama()
    attention = model.model.layers[0].self_attn
    x = torch.randn(1, 5, model.config.hidden_size)
    y = torch.randn(1, 5, model.config.hidden_size)
    with torch.inference_mode(), packed_linears(model, True):
        q = attention.q_proj(x)  # leaves k and v of x pending
        k_other = attention.k_proj(y)  # another input: its own product, not x's columns
    torch.testing.assert_close(q, nn.functional.linear(x, attention.q_proj.weight), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(
        k_other, nn.functional.linear(y, attention.k_proj.weight), rtol=1e-4, atol=1e-5
    )
    with torch.no_grad():
        attention.v_proj.weight.mul_(-1.0)  # bumps the version: the fused pack is rebuilt
    with torch.inference_mode(), packed_linears(model, True):
        attention.q_proj(x)
        v = attention.v_proj(x)
    torch.testing.assert_close(v, nn.functional.linear(x, attention.v_proj.weight), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("env", ["all", "auto"])
def test_greedy_generate_batch_equals_generate_fused(env, monkeypatch) -> None:
    monkeypatch.setenv(RULE_ENV, env)
    model = tiny_llama()
    prompts = prompts_of_lengths([5, 17, 30, 9], seed=4)
    outputs = model.generate_batch(
        prompts,
        max_new_tokens=8,
        continuous_batching_config=ContinuousBatchingConfig(page_size=16),
        progress_bar=False,
    )
    for i, prompt in enumerate(prompts):
        assert outputs[f"req_{i}"].generated_tokens == greedy_reference(model, prompt, 8)


def test_siblings_on_other_inputs_unfuse_the_group(monkeypatch) -> None:
    """Cross-attention's pattern (q on x, k and v on y): exact, and after the first broken call the group
    stops computing a fused product per call."""
    model = tiny_llama()
    attention = model.model.layers[0].self_attn
    x = torch.randn(1, 5, model.config.hidden_size)
    y = torch.randn(1, 7, model.config.hidden_size)
    calls = count_products(monkeypatch)
    # oneDNN's calls are counted: a few float32 rows would take the small-row product (small_rows.py) instead
    monkeypatch.setenv("TRANSFORMERS_CB_SMALL_ROW_PRODUCTS", "0")
    with torch.inference_mode(), packed_linears(model, True):
        outputs = []
        for _ in range(3):
            outputs += [attention.q_proj(x), attention.k_proj(y), attention.v_proj(y)]
    for i, (proj, inp) in enumerate(
        [(attention.q_proj, x), (attention.k_proj, y), (attention.v_proj, y)] * 3
    ):
        torch.testing.assert_close(outputs[i], nn.functional.linear(inp, proj.weight), rtol=1e-4, atol=1e-5)
    # q: the fused product of x; k on y breaks the pattern: own products from there on (1 + 2, 3, 3).
    assert len(calls) == 1 + 1 + 1 + 3 + 3
