"""torchao int8 weight-only Linears on the native `int8_matmul` (runner/products/torchao_linear.py): the product against
torchao's own, which weights it takes, the run-scoped forwards, and the bytes such weights really hold.

Skipped, with the reason, where torchao is not installed (the `torchao` extra) or the native library cannot
be built.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.support.models import tiny_llama
from transformers_cb.attention.native.kernel import ensure_native_module
from transformers_cb.runner.products import torchao_linear
from transformers_cb.runner.products.packed_linear import PackRule
from transformers_cb.runner.products.packed_model import pack_bytes
from transformers_cb.runner.products.quantized_linear import dequantize_blocks
from transformers_cb.runner.products.torchao_linear import (
    DIRECT_MAX_ROWS,
    int8_product,
    intx_block_bytes,
    intx_missing_bytes,
    intx_reason,
    is_native_int8,
    native_reason,
    prepare_intx_blocks,
    tensor_bytes,
    torchao_bytes,
    torchao_linears,
)

quantization = pytest.importorskip(
    "torchao.quantization", reason="torchao is not installed (pip install 'transformers-cb[torchao]')"
)
OPS = ensure_native_module(timeout=900)
needs_native = pytest.mark.skipif(OPS is None, reason="the native library cannot be built here")
DTYPES = [torch.float32, torch.bfloat16]


def int8_linear(
    in_features: int, out_features: int, dtype: torch.dtype, seed: int = 0, **config
) -> nn.Linear:
    torch.manual_seed(seed)
    linear = nn.Linear(in_features, out_features).to(dtype)
    quantization.quantize_(linear, quantization.Int8WeightOnlyConfig(**config))
    return linear


def torchao_product(x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    with torch.inference_mode():
        return F.linear(x, linear.weight, linear.bias)


def native_product(x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    with torch.inference_mode():
        output = int8_product(x, linear.weight, linear.bias)
    assert output is not None
    return output


@needs_native
@pytest.mark.parametrize("granularity", ["row", "tensor"])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16])
@pytest.mark.parametrize("shape", [(64, 48), (200, 37), (7, 5), (576, 160)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_product_rounds_where_torchao_rounds(dtype, shape, rows, granularity) -> None:
    """Integer-valued x: every partial sum is an exact float32 integer, so the order of the sums cannot
    matter and torchao's result and ours must agree bit for bit. The sums need more bits than bfloat16
    holds, so rounding at another point than torchao (the sum times the scale rounded once) would differ."""
    in_features, out_features = shape
    config = {"granularity": quantization.PerTensor()} if granularity == "tensor" else {}
    linear = int8_linear(in_features, out_features, dtype, **config)
    generator = torch.Generator().manual_seed(rows)
    x = torch.randint(-8, 8, (rows, in_features), generator=generator).to(dtype)
    want = torchao_product(x, linear)
    got = native_product(x, linear)
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    assert torch.equal(got, want)
    if dtype == torch.bfloat16 and in_features >= 64:
        # The test can fail: the once-rounded product differs from torchao's.
        weight = linear.weight
        sums = x.float() @ weight.qdata.float().T
        once = (sums * weight.scale.reshape(-1).float()).to(dtype) + linear.bias
        assert not torch.equal(once, want)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_random_inputs_differ_only_by_the_order_of_the_sums(dtype) -> None:
    linear = int8_linear(576, 1536, dtype)
    x = torch.randn(8, 3, 576, generator=torch.Generator().manual_seed(1)).to(dtype)  # a 3-D input
    want, got = torchao_product(x, linear), native_product(x, linear)
    assert got.shape == want.shape == (8, 3, 1536)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # the float32 sums' order flips at most a rounding of the bfloat16 sum: one ulp, rarely
        differ = got != want
        assert differ.float().mean() < 0.01
        ulp = torch.finfo(torch.bfloat16).eps * want.float().abs()
        assert ((got.float() - want.float()).abs() <= ulp)[differ].all()


def test_which_weights_the_native_product_takes() -> None:
    assert native_reason(int8_linear(64, 32, torch.float32).weight) is None
    assert native_reason(int8_linear(64, 32, torch.bfloat16).weight) is None
    per_group = int8_linear(64, 32, torch.float32, granularity=quantization.PerGroup(32)).weight
    assert "per-group" in (native_reason(per_group) or "")
    dynamic = nn.Linear(64, 32)
    quantization.quantize_(dynamic, quantization.Int8DynamicActivationInt8WeightConfig())
    assert "not weight-only" in (native_reason(dynamic.weight) or "")
    assert native_reason(nn.Linear(64, 32).weight) == "not a torchao Int8Tensor"
    int4 = nn.Linear(64, 32)
    quantization.quantize_(
        int4,
        quantization.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=quantization.PerGroup(32)),
    )
    assert native_reason(int4.weight) == "not a torchao Int8Tensor"

    class OwnLinear(nn.Linear):
        pass

    subclass = OwnLinear(64, 32)
    quantization.quantize_(subclass, quantization.Int8WeightOnlyConfig())
    assert not is_native_int8(subclass)  # its forward may differ from nn.Linear's


@needs_native
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_run_scoped_forwards(dtype, monkeypatch) -> None:
    model = tiny_llama().to(dtype)
    quantization.quantize_(model, quantization.Int8WeightOnlyConfig())
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    calls: list[int] = []

    def counting(x, weight, bias):
        calls.append(x.numel() // x.shape[-1])
        return int8_product(x, weight, bias)

    monkeypatch.setattr(torchao_linear, "int8_product", counting)
    few = torch.randint(3, 300, (1, DIRECT_MAX_ROWS[dtype]))
    many = torch.randint(3, 300, (1, DIRECT_MAX_ROWS[dtype] + 1))
    with torch.inference_mode():
        want_few, want_many = model(few).logits, model(many).logits
        with torchao_linears(model, enabled=True) as count:
            assert count == len(linears) == 2 * 7 + 1
            assert all("forward" in m.__dict__ for m in linears)
            got_few = model(few).logits
            assert calls and set(calls) == {DIRECT_MAX_ROWS[dtype]}
            calls.clear()
            got_many = model(many).logits  # prefill rows: torchao's own product
            assert not calls
    assert not any("forward" in m.__dict__ for m in linears)  # restored
    assert torch.equal(got_many, want_many)
    tolerance = {torch.float32: 1e-4, torch.bfloat16: 5e-2}[dtype]
    torch.testing.assert_close(got_few, want_few, rtol=tolerance, atol=tolerance)
    with torchao_linears(model, enabled=False) as count:
        assert count == 0


def test_quantized_weights_count_their_real_bytes() -> None:
    for dtype in DTYPES:
        weight = int8_linear(64, 32, dtype).weight
        real = sum(t.numel() * t.element_size() for t in (weight.qdata, weight.scale, weight.zero_point))
        assert tensor_bytes(weight) == real == 64 * 32 + 32 * 4 + 32
        assert weight.numel() * weight.element_size() == 64 * 32 * dtype.itemsize  # what a naive count says
    assert tensor_bytes(torch.zeros(3, 5)) == 60


def test_packing_and_its_memory_check_count_no_copy_for_int8_linears(monkeypatch) -> None:
    """The native product reads the int8 rows in place: no packed copy, so the packing's memory check
    (`pack_bytes`) counts the float Linears' copies only, and a wholly quantized model none."""
    monkeypatch.setenv("TRANSFORMERS_CB_SMALL_ROW_PRODUCTS", "0")  # one copy per float Linear (no row packs)
    model = tiny_llama()
    float_bytes = sum(m.weight.numel() * 4 for m in model.modules() if isinstance(m, nn.Linear))
    assert pack_bytes(model, PackRule(every_weight=True)) == (float_bytes, float_bytes)
    mlp = [m for name, m in model.named_modules() if isinstance(m, nn.Linear) and ".mlp." in name]
    quantization.quantize_(
        model,
        quantization.Int8WeightOnlyConfig(),
        filter_fn=lambda m, name: isinstance(m, nn.Linear) and ".mlp." in name,
    )
    mlp_float_bytes = sum(m.in_features * m.out_features * 4 for m in mlp)
    total, missing = pack_bytes(model, PackRule(every_weight=True))
    assert total == missing == float_bytes - mlp_float_bytes
    assert torchao_bytes(model) == sum(tensor_bytes(m.weight) for m in mlp)
    assert torchao_bytes(model) < mlp_float_bytes / 3
    quantization.quantize_(  # the rest too
        model,
        quantization.Int8WeightOnlyConfig(),
        filter_fn=lambda m, name: isinstance(m, nn.Linear) and ".mlp." not in name,
    )
    assert pack_bytes(model, PackRule(every_weight=True)) == (0, 0)


def intx_linear(
    in_features: int, out_features: int, dtype: torch.dtype, group: int = 32, seed: int = 0, **config
) -> nn.Linear:
    torch.manual_seed(seed)
    linear = nn.Linear(in_features, out_features).to(dtype)
    settings = {"weight_dtype": torch.int4, "granularity": quantization.PerGroup(group), **config}
    quantization.quantize_(linear, quantization.IntxWeightOnlyConfig(**settings))
    return linear


@pytest.mark.parametrize("group", [32, 64, 128])
def test_intx_blocks_hold_torchaos_dequantized_weight(group: int) -> None:
    linear = intx_linear(128, 48, torch.bfloat16, group)
    assert intx_reason(linear.weight) is None
    model = nn.Sequential(linear)
    assert intx_missing_bytes(model) == 48 * 128 // 32 * 18
    assert prepare_intx_blocks(model) == 1
    assert intx_missing_bytes(model) == 0 and intx_block_bytes(model) == 48 * 128 // 32 * 18
    entry = torchao_linear._intx_blocks[linear]
    want = linear.weight.dequantize().float()  # torchao's own dequantization
    assert torch.equal(dequantize_blocks(entry.blocks, entry.qtype, torch.bfloat16).float(), want)


def test_intx_weights_that_are_not_blocks_keep_torchaos_product() -> None:
    float32 = nn.Sequential(intx_linear(64, 16, torch.float32))  # float32 scales
    asymmetric = nn.Sequential(
        intx_linear(64, 16, torch.bfloat16, mapping_type=quantization.MappingType.ASYMMETRIC)
    )
    for model, reason in ((float32, "float16 values"), (asymmetric, "asymmetric")):
        assert prepare_intx_blocks(model) == 0
        assert reason in torchao_linear._intx_blocks[model[0]]
        with torchao_linears(model, enabled=True) as count:
            assert count == 0
    assert intx_reason(int8_linear(64, 16, torch.bfloat16).weight) is not None  # an Int8Tensor: not Intx


@needs_native
def test_intx_linears_run_the_blocks_product_on_few_rows_and_see_a_replaced_weight(monkeypatch) -> None:
    linear = intx_linear(128, 32, torch.bfloat16)
    model = nn.Sequential(linear)
    prepare_intx_blocks(model)
    calls: list[int] = []
    original = torchao_linear.quantized_product

    def counting(x, blocks, qtype):
        calls.append(x.shape[0])
        return original(x, blocks, qtype)

    monkeypatch.setattr(torchao_linear, "quantized_product", counting)
    few = torch.randn(2, 3, 128).to(torch.bfloat16)
    many = torch.randn(1, 40, 128).to(torch.bfloat16)
    with torch.inference_mode():
        want_few, want_many = linear(few), linear(many)
        with torchao_linears(model, enabled=True) as count:
            assert count == 1
            got_few, got_many = linear(few), linear(many)
            assert calls == [6]  # the 40 rows ran torchao's own product
            linear.weight = intx_linear(128, 32, torch.bfloat16, seed=1).weight  # replaced: blocks stale
            calls.clear()
            replaced = linear(few)
            assert not calls and torch.equal(replaced, F.linear(few, linear.weight, linear.bias))
    assert torch.equal(got_many, want_many)
    torch.testing.assert_close(got_few, want_few, rtol=2e-2, atol=2e-2)  # the order of the sums
    assert intx_missing_bytes(model) == 32 * 128 // 32 * 18  # the replaced weight's, until prepared again


def test_intx_blocks_are_written_only_where_they_fit_beside_the_cache(monkeypatch) -> None:
    from transformers_cb.runner import step_options

    warnings: list[str] = []
    model = nn.Sequential(intx_linear(128, 32, torch.bfloat16))
    monkeypatch.setattr(step_options, "free_memory_bytes", lambda device: 1000)  # room for no block
    monkeypatch.setattr(step_options, "warn_once", warnings.append)
    step_options.prepare_torchao_linears(model, None)
    assert intx_missing_bytes(model) == 32 * 128 // 32 * 18 and "torchao's own product" in warnings[-1]
    monkeypatch.setattr(step_options, "free_memory_bytes", lambda device: 1 << 30)
    step_options.prepare_torchao_linears(model, None)
    assert intx_missing_bytes(model) == 0
