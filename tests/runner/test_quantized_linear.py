"""The quantized products (`runner/products/quantized_linear.py`, attention/native/quantized/native_quant_source.py) against
`x @ gguf.quants.dequantize(W).T`: random blocks of Q8_0, Q4_0 and Q4_1, float32 and bfloat16 inputs, odd
shapes, row counts on both sides of `DIRECT_MAX_ROWS` (the native product and the dequantized tiles); the
dequantization itself bitwise equal to gguf's, natively and by the torch fallback; the modules."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from transformers_cb.attention.native.kernel import ensure_native_module
from transformers_cb.runner.products import quantized_linear
from transformers_cb.runner.products.quantized_linear import (
    DIRECT_MAX_ROWS,
    QuantizedEmbedding,
    QuantizedLinear,
    dequantize_blocks,
    quantized_bytes,
    quantized_product,
    row_bytes,
)

gguf = pytest.importorskip("gguf", reason="the gguf package writes the reference blocks")
QTYPES = [gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1]
OPS = ensure_native_module()
native = pytest.mark.skipif(OPS is None, reason="the native library cannot be built here")
# (output columns, inputs): odd column counts, one block, several, not a multiple of the column grain.
SHAPES = [(1, 32), (33, 96), (70, 160), (17, 576)]
ROWS = [1, 2, 3, 5, 8, 9, 16, 17, 40]  # every tile and column-group shape of the direct product


def random_blocks(out_features: int, in_features: int, qtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks uint8 [N, row bytes], their float32 weight as gguf dequantizes it)."""
    values = np.random.default_rng(seed).standard_normal((out_features, in_features)).astype(np.float32)
    values[0, :5] = 0.0  # a block with zeros (Q8_0's zero scale, Q4_1's min)
    blocks = gguf.quants.quantize(values, qtype)
    weight = gguf.quants.dequantize(blocks, qtype)
    return torch.from_numpy(np.array(blocks)), torch.from_numpy(np.array(weight, dtype=np.float32))


def reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ W.T in float64 (the exact sums), W as the model of x's dtype holds it."""
    return (x.double() @ weight.to(x.dtype).double().T).float()


def assert_close(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    want = reference(x, weight)
    assert got.dtype == x.dtype and got.shape == want.shape
    if x.dtype == torch.float32:
        # float32 sums in another order: within a few ulps of the sum of magnitudes.
        scale = (x.abs().double() @ weight.abs().double().T).float()
        assert ((got - want).abs() <= scale * 2e-6 + 1e-6).all(), (got - want).abs().max()
    else:  # float32 sums rounded to bfloat16 once: within one bfloat16 rounding (and a float32 ulp or two)
        assert ((got.float() - want).abs() <= want.abs() * 2**-8 + 1e-5).all(), (
            (got.float() - want).abs().max()
        )


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_dequantization_is_gguf_s_bit_for_bit(qtype) -> None:
    blocks, weight = random_blocks(37, 160, qtype, seed=1)
    assert torch.equal(quantized_linear._dequantize_torch(blocks, int(qtype)), weight)
    if OPS is not None:
        assert torch.equal(dequantize_blocks(blocks, int(qtype)), weight)
        assert torch.equal(dequantize_blocks(blocks, int(qtype), torch.bfloat16), weight.bfloat16())


@native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_native_product_equals_the_dequantized_product(qtype, dtype: torch.dtype) -> None:
    for i, (out_features, in_features) in enumerate(SHAPES):
        blocks, weight = random_blocks(out_features, in_features, qtype, seed=10 + i)
        for rows in ROWS:
            x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows)).to(dtype)
            assert_close(OPS.quant_matmul(x, blocks, int(qtype)), x, weight)  # the direct product at any rows
            assert_close(quantized_product(x, blocks, int(qtype)), x, weight)  # direct or tiles by the rows


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_the_tiled_path_and_the_fallback(qtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """Beyond `DIRECT_MAX_ROWS` the weight is dequantized a tile of columns at a time (here 64 weights a
    tile: many tiles, the last one short); without the native library torch ops dequantize it."""
    blocks, weight = random_blocks(45, 64, qtype, seed=3)
    x = torch.randn(DIRECT_MAX_ROWS[torch.float32] + 5, 64, generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(quantized_linear, "TILE_ELEMENTS", 64 * 4)
    assert_close(quantized_product(x, blocks, int(qtype)), x, weight)
    monkeypatch.setattr(quantized_linear, "native_module", lambda: None)
    assert_close(quantized_product(x[:2], blocks, int(qtype)), x[:2], weight)
    assert torch.equal(dequantize_blocks(blocks, int(qtype)), weight)


def test_the_native_product_refuses_what_it_cannot_read() -> None:
    if OPS is None:
        pytest.skip("the native library cannot be built here")
    blocks, _ = random_blocks(4, 64, gguf.GGMLQuantizationType.Q8_0, seed=0)
    with pytest.raises(RuntimeError, match="Q4_0 \\(2\\), Q4_1 \\(3\\) and Q8_0 \\(8\\) only"):
        OPS.quant_matmul(torch.randn(1, 64), blocks, 12)
    with pytest.raises(RuntimeError, match="x \\[R, 64\\] expected"):
        OPS.quant_matmul(torch.randn(1, 32), blocks, 8)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        OPS.quant_matmul(torch.randn(1, 64).half(), blocks, 8)


def test_the_modules() -> None:
    qtype = int(gguf.GGMLQuantizationType.Q4_1)
    blocks, weight = random_blocks(48, 64, gguf.GGMLQuantizationType.Q4_1, seed=5)
    bias = torch.randn(48)
    linear = QuantizedLinear(blocks, qtype, 64, bias)
    x = torch.randn(2, 3, 64)
    got = linear(x)
    assert got.shape == (2, 3, 48)
    assert torch.allclose(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    assert list(dict(linear.named_parameters())) == ["bias"]  # the blocks are a buffer: no gradient
    embedding = QuantizedEmbedding(blocks, qtype, 64, torch.bfloat16)
    ids = torch.tensor([[3, 0, 47]])
    assert torch.equal(embedding(ids), F.embedding(ids, weight.bfloat16()))
    tied = torch.nn.Sequential(linear, embedding)
    assert quantized_bytes(tied) == 48 * row_bytes(qtype, 64)  # one tensor shared: counted once
    with pytest.raises(ValueError, match="do not hold 96 inputs"):
        QuantizedLinear(blocks, qtype, 96)


# The lane layout (attention/native/quantized/native_lanes_source.py): 16 columns' blocks side by side.
LANE_QTYPES = QTYPES
lanes_built = pytest.mark.skipif(
    OPS is None or not OPS.quant_lanes_available(), reason="the lane product needs AVX512-BF16"
)


@native
@pytest.mark.parametrize("qtype", LANE_QTYPES, ids=lambda q: q.name)
def test_the_lane_layout_holds_the_same_blocks(qtype, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks, weight = random_blocks(48, 160, qtype, seed=7)
    lanes = OPS.quant_lanes_pack(blocks, int(qtype))
    assert lanes.shape == blocks.shape and not torch.equal(lanes, blocks)
    kernel_qtype = quantized_linear.LANES + int(qtype)
    assert torch.equal(OPS.quant_lanes_unpack(lanes, kernel_qtype), blocks)
    assert torch.equal(quantized_linear._unpack_lanes_torch(lanes, int(qtype)), blocks)
    assert torch.equal(dequantize_blocks(lanes, kernel_qtype), weight)
    assert torch.equal(dequantize_blocks(lanes, kernel_qtype, torch.bfloat16), weight.bfloat16())
    with pytest.raises(RuntimeError, match="multiple of 16 columns"):
        OPS.quant_lanes_pack(blocks[:40].contiguous(), int(qtype))
    with pytest.raises(RuntimeError, match="Q4_0 \\(2\\), Q4_1 \\(3\\) and Q8_0 \\(8\\) only"):
        OPS.quant_lanes_pack(blocks, 12)
    ids = torch.tensor([[0, 47, 16], [5, 5, 31]])
    for dtype in (torch.float32, torch.bfloat16):  # an embedding's lookup: natively and by torch ops
        want = F.embedding(ids, weight.to(dtype))
        assert torch.equal(OPS.quant_lanes_rows(lanes, kernel_qtype, ids, dtype), want)
        assert torch.equal(quantized_linear.lanes_rows(lanes, kernel_qtype, ids, dtype), want)
    with pytest.raises(RuntimeError, match="out of range"):
        OPS.quant_lanes_rows(lanes, kernel_qtype, torch.tensor([48]), torch.float32)
    monkeypatch.setattr(quantized_linear, "native_module", lambda: None)  # torch ops: the same values
    assert torch.equal(quantized_linear.lanes_rows(lanes, kernel_qtype, ids, torch.bfloat16), want)
    assert torch.equal(dequantize_blocks(lanes, kernel_qtype), weight)


def assert_lanes_close(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """The lane product sums exact weights (not rounded to bfloat16) in float32 and rounds once: within one
    bfloat16 rounding of the exact sum, and float32's rounding of the biased sums (128 + q) beside it."""
    want = (x.double() @ weight.double().T).float()
    scale = (x.abs().double() @ weight.abs().double().T).float()
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert ((got.float() - want).abs() <= want.abs() * 2**-8 + scale * 2**-16 + 1e-6).all(), (
        (got.float() - want).abs().max()
    )


@lanes_built
@pytest.mark.parametrize("qtype", LANE_QTYPES, ids=lambda q: q.name)
def test_the_lane_product(qtype) -> None:
    kernel_qtype = quantized_linear.LANES + int(qtype)
    for i, (out_features, in_features) in enumerate([(16, 32), (48, 96), (80, 576), (1536, 64)]):
        blocks, weight = random_blocks(out_features, in_features, qtype, seed=20 + i)
        lanes = OPS.quant_lanes_pack(blocks, int(qtype))
        for rows in ROWS:
            x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows)).bfloat16()
            assert_lanes_close(OPS.quant_matmul(x, lanes, kernel_qtype), x, weight)  # at any rows
            assert torch.equal(
                quantized_product(x, lanes, kernel_qtype), OPS.quant_matmul(x, lanes, kernel_qtype)
            )
        # float32 rows on a lane layout: the GGUF blocks' product, or the tiles beyond its rows
        x = torch.randn(3, in_features)
        assert torch.equal(OPS.quant_matmul(x, lanes, kernel_qtype), OPS.quant_matmul(x, blocks, int(qtype)))
        x = torch.randn(DIRECT_MAX_ROWS[torch.float32] + 1, in_features)
        assert torch.equal(quantized_product(x, lanes, kernel_qtype), F.linear(x, weight))


@lanes_built
def test_a_bfloat16_linear_goes_over_lanes_and_only_it() -> None:
    q4_1, q8_0 = int(gguf.GGMLQuantizationType.Q4_1), int(gguf.GGMLQuantizationType.Q8_0)
    blocks, weight = random_blocks(48, 64, gguf.GGMLQuantizationType.Q4_1, seed=5)
    bias = torch.randn(48).bfloat16()
    linear = QuantizedLinear(blocks, q4_1, 64, bias, torch.bfloat16)
    x = torch.randn(2, 3, 64).bfloat16()
    before = linear(x)
    assert (
        quantized_linear.repack_over_lanes([linear]) and linear.kernel_qtype == quantized_linear.LANES + q4_1
    )
    assert "lanes" in repr(linear) and not quantized_linear.repack_over_lanes([linear])  # once
    assert torch.equal(
        linear(x),
        (OPS.quant_matmul(x.reshape(6, 64), linear.blocks, linear.kernel_qtype) + bias).reshape(2, 3, 48),
    )
    assert (linear(x).float() - before.float()).abs().max() <= before.float().abs().max() * 2**-6
    many = torch.randn(DIRECT_MAX_ROWS[torch.float32] + 1, 64)  # float32 rows: the tiles, from the lanes
    assert torch.equal(linear(many), F.linear(many, weight) + bias)
    assert not quantized_linear.repack_over_lanes([QuantizedLinear(blocks, q4_1, 64)])  # float32 rows
    assert not quantized_linear.repack_over_lanes(
        [QuantizedLinear(blocks[:40].contiguous(), q4_1, 64, None, torch.bfloat16)]
    )
    blocks8, weight8 = random_blocks(48, 64, gguf.GGMLQuantizationType.Q8_0, seed=5)
    head = QuantizedLinear(blocks8, q8_0, 64, None, torch.bfloat16)
    embedding = QuantizedEmbedding(blocks8, q8_0, 64, torch.bfloat16)
    ids = torch.tensor([[3, 0, 47]])
    # a tied embedding and head: repacked once for both, or not at all
    assert not quantized_linear.repack_over_lanes(
        [head, QuantizedEmbedding(blocks8, q8_0, 64, torch.float32)]
    )
    assert quantized_linear.repack_over_lanes([head, embedding]) and head.blocks is embedding.blocks
    assert torch.equal(embedding(ids), F.embedding(ids, weight8.bfloat16())) and "lanes" in repr(embedding)
    assert_lanes_close(head(x.reshape(6, 64)), x.reshape(6, 64), weight8)
