"""The native decoder-layer ops (`runner/layer_ops/native_layers.py`, attention/native/native_layer_source.py): each op bitwise
equal to transformers' module on random inputs (float32 and bfloat16, strided views, widths off the vector
size), the table's recognition, the installs counted and restored, the module's own path where the native
one does not apply, a class whose check fails left alone, and greedy parity with `generate()` on models
whose attention is sharp."""

from __future__ import annotations

import logging
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama import modeling_llama
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from tests.support.models import build_model, build_tiny_model, tiny_llama, tiny_qwen3
from tests.support.prompts import prompts_of_lengths
from tests.support.reference import greedy_reference
from tests.support.sharp import sharpen
from transformers_cb import ContinuousBatchingConfig
from transformers_cb.attention.native.kernel import ensure_native_module
from transformers_cb.engine import engine as engine_module
from transformers_cb.runner.layer_ops import native_layers
from transformers_cb.runner.layer_ops.layer_checks import Verdicts
from transformers_cb.runner.layer_ops.layer_forms import is_pre_norm_layer, is_silu_mlp, norm_form, references

OPS = ensure_native_module()
pytestmark = pytest.mark.skipif(OPS is None, reason="the native library cannot be built here")
DTYPES = [torch.float32, torch.bfloat16]
WIDTHS = [7, 16, 64, 100, 576, 1536]


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)


def llama_norm(width: int, dtype: torch.dtype, cls: type = LlamaRMSNorm) -> nn.Module:
    norm = cls(width, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(randn(width, dtype=dtype, seed=99))
    return norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("rows", [1, 5, 16, 300])
def test_rms_norm_is_the_module_bitwise(dtype, width, rows) -> None:
    norm = llama_norm(width, dtype)
    x = randn(rows, width, dtype=dtype, seed=rows)
    out = torch.empty_like(x)
    OPS.rms_norm(x, norm.weight.data, norm.variance_epsilon, False, out)
    assert torch.equal(out, norm(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [64, 100, 576])
def test_gemma_rms_norm_is_the_module_bitwise(dtype, width) -> None:
    norm = GemmaRMSNorm(width, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(randn(width, dtype=dtype, seed=98) * 0.1)
    x = randn(9, width, dtype=dtype, seed=1)
    out = torch.empty_like(x)
    OPS.rms_norm(x, norm.weight.data, norm.eps, True, out)
    assert torch.equal(out, norm(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
def test_add_rms_norm_is_the_add_then_the_module_bitwise(dtype, width) -> None:
    norm = llama_norm(width, dtype)
    residual, x = randn(1, 13, width, dtype=dtype, seed=2), randn(1, 13, width, dtype=dtype, seed=3)
    summed, normed = torch.empty_like(x), torch.empty_like(x)
    OPS.add_rms_norm(residual, x, norm.weight.data, norm.variance_epsilon, False, summed, normed)
    assert torch.equal(summed, residual + x)
    assert torch.equal(normed, norm(residual + x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_norm_over_strided_heads_is_the_module_bitwise(dtype) -> None:
    # Qwen3's q norm: [B, T, H, D] heads viewed out of the q columns of a fused q/k/v product
    heads, dim, tokens = 4, 16, 11
    fused = randn(1, tokens, heads * dim * 2 + 8, dtype=dtype, seed=4)
    q = fused[..., : heads * dim].view(1, tokens, heads, dim)
    norm = llama_norm(dim, dtype, Qwen3RMSNorm)
    out = torch.empty(q.shape, dtype=dtype)
    OPS.rms_norm(q, norm.weight.data, norm.variance_epsilon, False, out)
    assert torch.equal(out, norm(q))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [7, 37, 100, 1536])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_silu_mul_is_silu_times_up_bitwise(dtype, width, rows) -> None:
    gate, up = randn(rows, width, dtype=dtype, seed=5), randn(rows, width, dtype=dtype, seed=6)
    out = torch.empty_like(gate)
    OPS.silu_mul(gate, up, out)
    assert torch.equal(out, F.silu(gate) * up)
    # the columns of a fused gate/up product: strided rows
    fused = torch.cat([gate, up], dim=-1)
    g, u = fused[:, :width], fused[:, width:]
    out = torch.empty_like(gate)
    OPS.silu_mul(g, u, out)
    assert torch.equal(out, F.silu(g) * u)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("dim", "tokens"), [(8, 1), (16, 7), (64, 33), (128, 5)])
def test_rotary_is_llamas_bitwise(dtype, dim, tokens) -> None:
    heads, kv_heads = 6, 2
    fused = randn(1, tokens, (heads + 2 * kv_heads) * dim, dtype=dtype, seed=7)
    q = fused[..., : heads * dim].view(1, tokens, heads, dim).transpose(1, 2)
    k = fused[..., heads * dim : (heads + kv_heads) * dim].view(1, tokens, kv_heads, dim).transpose(1, 2)
    cos, sin = randn(1, tokens, dim, dtype=dtype, seed=8), randn(1, tokens, dim, dtype=dtype, seed=9)
    expected_q, expected_k = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    native = native_layers._rotary(OPS, modeling_llama.apply_rotary_pos_emb)
    with torch.no_grad():
        got_q, got_k = native(q, k, cos, sin)
    assert torch.equal(got_q, expected_q) and torch.equal(got_k, expected_k)
    # tokens outer, heads inner, as torch's product leaves them: the layout the attention glue reads as is
    assert got_q.transpose(1, 2).is_contiguous() and expected_q.transpose(1, 2).is_contiguous()


# -- the table ------------------------------------------------------------------------------------


def test_the_table_recognises_llama_shaped_families_by_their_code() -> None:
    qwen3 = tiny_qwen3()
    layer = qwen3.model.layers[0]
    assert norm_form(layer.input_layernorm) == "llama"
    assert norm_form(layer.self_attn.q_norm) == "llama"  # Qwen3's own class, Llama's code
    assert norm_form(GemmaRMSNorm(8)) == "gemma"
    assert is_silu_mlp(layer.mlp)
    assert is_pre_norm_layer(layer)


def test_a_module_of_other_code_is_not_recognised() -> None:
    class ScaledNorm(LlamaRMSNorm):
        def forward(self, hidden_states):
            return super().forward(hidden_states) * 2

    assert norm_form(ScaledNorm(8)) is None
    model = tiny_llama(hidden_act="gelu_pytorch_tanh")
    assert not is_silu_mlp(model.model.layers[0].mlp)  # Llama's code, another activation
    norm = LlamaRMSNorm(8)
    norm.forward = lambda x: x  # a forward of the instance's own (accelerate's hooks set one)
    assert norm_form(norm) is None
    # Gemma 2's layer (a norm after attention, two around the MLP): its forward is wrapped for gradient
    # checkpointing by the same wrapper as Llama's, so the wrapped code is what must differ
    gemma2 = build_tiny_model("gemma2", seed=0)
    assert not is_pre_norm_layer(gemma2.model.layers[0])
    assert norm_form(gemma2.model.layers[0].pre_feedforward_layernorm) == "gemma"


# -- installs -------------------------------------------------------------------------------------


def installed(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if "forward" in m.__dict__]


def test_installs_are_counted_and_restored() -> None:
    model = tiny_llama()
    with native_layers.native_layers(model) as first:
        assert first == len(installed(model)) + 1  # the modeling file's rotary too
        assert modeling_llama.apply_rotary_pos_emb is not references().llama_rotary
        with native_layers.native_layers(model) as second:  # a second session on the same model
            assert second == first
        assert len(installed(model)) == first - 1  # the second session's exit leaves the first's
    assert installed(model) == []
    assert modeling_llama.apply_rotary_pos_emb is references().llama_rotary


def test_the_switch_turns_them_off(monkeypatch) -> None:
    monkeypatch.setenv(native_layers.ENV_SWITCH, "0")
    model = tiny_llama()
    with native_layers.native_layers(model) as count:
        assert count == 0 and installed(model) == []


def test_uninstall_restores_a_session_still_open() -> None:
    model = tiny_llama()
    with native_layers.native_layers(model):
        native_layers.restore_native_layers()
        assert installed(model) == []
        assert modeling_llama.apply_rotary_pos_emb is references().llama_rotary
    assert installed(model) == []


def test_autograd_takes_the_modules_own_path() -> None:
    model = tiny_llama()
    ids = torch.tensor([[5, 6, 7, 8]])
    with native_layers.native_layers(model):
        loss = model(input_ids=ids).logits.sum()
        loss.backward()  # training inside the block keeps its gradients
    assert model.model.layers[0].input_layernorm.weight.grad is not None


def test_a_class_that_fails_its_check_keeps_its_forward(monkeypatch, caplog) -> None:
    class WrongOps:
        """The library with an RMSNorm that is off by one ulp: the check at first sight must see it."""

        def __getattr__(self, name):
            return getattr(OPS, name)

        def rms_norm(self, x, weight, eps, gemma, out):
            OPS.rms_norm(x, weight, eps, gemma, out)
            out.copy_(torch.nextafter(out, torch.full_like(out, float("inf"))))

    monkeypatch.setattr(native_layers, "native_module", lambda: WrongOps())
    monkeypatch.setattr(native_layers, "VERDICTS", Verdicts())
    model = tiny_llama()
    with caplog.at_level(logging.WARNING), native_layers.native_layers(model):
        kinds = {type(m).__name__ for m in installed(model)}
    assert "LlamaRMSNorm" not in kinds and "LlamaDecoderLayer" not in kinds and "LlamaMLP" in kinds
    assert "differs from" in caplog.text


# -- greedy parity on sharp models ----------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral"])
def test_generate_batch_equals_generate_with_native_layers(family, monkeypatch) -> None:
    shape = {
        "hidden_size": 64,
        "intermediate_size": 100,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 300,
        "max_position_embeddings": 512,
    }
    if family == "qwen3":
        shape["head_dim"] = 16
    model = build_model(family, seed=0, **shape)
    scaled = sharpen(model, 8.0)  # query / key scaled: attention far from uniform
    assert scaled > 0
    counts: list[int] = []
    real = native_layers.native_layers

    @contextmanager
    def counting(*args, **kwargs):
        with real(*args, **kwargs) as count:
            counts.append(count)
            yield count

    monkeypatch.setattr(engine_module, "native_layers", counting)
    prompts = prompts_of_lengths([5, 40, 17, 3, 70], seed=1)
    outputs = model.generate_batch(
        prompts,
        max_new_tokens=12,
        continuous_batching_config=ContinuousBatchingConfig(max_batch_tokens=32),
        progress_bar=False,
    )
    assert counts and all(c > 0 for c in counts)
    for i, prompt in enumerate(prompts):
        assert outputs[f"req_{i}"].generated_tokens == greedy_reference(model, prompt, 12), i
