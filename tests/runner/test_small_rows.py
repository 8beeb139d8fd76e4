"""The small-row products (runner/products/small_rows.py, attention/native/native_rows_source.py): the bfloat16
native loop against float32 sums and oneDNN's product (bias, odd widths, column counts off the block size),
the float32 one against float64 sums within float32's own error, the row rule, the route a packed product
takes by dtype, row count and switch, the row pack counted and rebuilt with its pack, a bf16 run's greedy
tokens like `generate()`'s (tie-aware) and a float32 run's equal to them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tests.support.models import tiny_llama
from tests.support.prompts import prompts_of_lengths
from tests.support.reference import greedy_reference
from transformers_cb import ContinuousBatchingConfig
from transformers_cb.parity.compare import compare_tokens
from transformers_cb.runner.products import packed_linear as packed_linear_module
from transformers_cb.runner.products import small_rows
from transformers_cb.runner.products.packed_linear import (
    PACKS,
    RULE_ENV,
    packed_linear_eager,
    pointwise,
    reorder,
)

OPS = (
    small_rows.rows_module()
    if packed_linear_module.unsupported_reason(torch.bfloat16, "cpu") is None
    else None
)
F32_OPS = (
    small_rows.rows_module(torch.float32)
    if packed_linear_module.unsupported_reason(torch.float32, "cpu") is None
    else None
)
needs_bf16_rows = pytest.mark.skipif(
    OPS is None, reason="the small-row product needs the native library built for AVX512-BF16 and oneDNN"
)
needs_f32_rows = pytest.mark.skipif(
    F32_OPS is None,
    reason="the float32 small-row product needs the native library built for AVX-512 or AVX2 + FMA, and oneDNN",
)


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@needs_bf16_rows
@pytest.mark.parametrize("shape", [(960, 576), (100, 71), (7, 33), (48, 40), (33, 2), (40, 64), (20000, 64)])
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 11, 16, 17, 33, 47, 64])
@pytest.mark.parametrize("with_bias", [True, False])
def test_native_loop_rounds_float32_sums_once(shape: tuple[int, int], rows: int, with_bias: bool) -> None:
    out_features, in_features = shape
    weight = randn(out_features, in_features, seed=1)
    bias = randn(out_features, seed=2) if with_bias else None
    x = randn(rows, in_features, seed=3)
    got = OPS.bf16_rows_matmul(x, small_rows.pack_rows(weight), bias, out_features)
    assert got.shape == (rows, out_features)
    # float64 sums of the exact products: the result is the float32 sum (off by its own rounding, at most
    # ~K * 2^-24 of the summed magnitudes) rounded once to bfloat16 (half a step: 2^-9 relative).
    exact = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    magnitude = x.double().abs() @ weight.double().abs().T + (0 if bias is None else bias.double().abs())
    bound = exact.abs() * 2**-8 + magnitude * in_features * 2**-23
    assert ((got.double() - exact).abs() <= bound).all()
    onednn = pointwise(x, reorder(weight), bias)
    assert (got != onednn).float().mean() < 0.05  # only the order of the float32 sums differs


@needs_bf16_rows
def test_native_loop_refuses_what_it_cannot_read() -> None:
    weight = randn(20, 8, seed=0)
    pack = small_rows.pack_rows(weight)
    with pytest.raises(RuntimeError, match="columns"):
        OPS.bf16_rows_matmul(randn(2, 6, seed=1), pack, None, 20)
    with pytest.raises(RuntimeError, match="x: bfloat16"):
        OPS.bf16_rows_matmul(randn(2, 8, seed=1).float(), pack, None, 20)
    with pytest.raises(RuntimeError, match="outputs"):
        OPS.bf16_rows_matmul(randn(2, 8, seed=1), pack, None, 40)
    three = OPS.bf16_rows_matmul(randn(2, 3, 8, seed=1), pack, None, 20)  # any leading dimensions
    assert three.shape == (2, 3, 20)


def test_row_rule() -> None:
    assert small_rows.row_limit(3072, 576, dtype=torch.float32) == small_rows.NO_AMX_F32_ROWS
    assert small_rows.row_limit(49152, 576, dtype=torch.float32) == small_rows.NO_AMX_F32_ROWS  # LM heads too
    assert small_rows.row_limit(49152, 576, amx=True, dtype=torch.float32) == small_rows.F32_ROWS
    assert small_rows.row_limit(3072, 576, dtype=torch.float32, lanes=8) == small_rows.AVX2_F32_ROWS
    assert small_rows.row_limit(3072, 576) == small_rows.row_limit(320, 192) == small_rows.NO_AMX_ROWS
    assert small_rows.row_limit(49152, 576) == small_rows.NO_AMX_ROWS  # without AMX an LM head too
    assert small_rows.row_limit(3072, 576, amx=True) == small_rows.AMX_ROWS
    assert small_rows.row_limit(3072, 570, amx=True) == small_rows.ROWS  # AMX tiles need a multiple of 32
    assert small_rows.row_limit(320, 190, amx=True) == small_rows.TINY_ROWS
    assert small_rows.row_limit(49152, 576, amx=True) == 0


def count_native(monkeypatch) -> list[int]:
    """The row counts of the native product's calls from now on."""
    calls: list[int] = []
    ops, f32_ops = small_rows.rows_module(), small_rows.rows_module(torch.float32)

    class Counting:
        def bf16_rows_matmul(self, x, packed, bias, out_features) -> torch.Tensor:
            calls.append(x.numel() // x.shape[-1])
            return ops.bf16_rows_matmul(x, packed, bias, out_features)

        def f32_rows_matmul(self, x, packed, bias, out_features) -> torch.Tensor:
            calls.append(-(x.numel() // x.shape[-1]))  # float32 calls counted negative
            return f32_ops.f32_rows_matmul(x, packed, bias, out_features)

        def bf16_rows_amx(self) -> bool:
            return ops is not None and ops.bf16_rows_amx()

        def f32_rows_lanes(self) -> int:
            return small_rows._lanes(f32_ops)

    found = {
        dtype: Counting() for dtype, native in ((torch.bfloat16, ops), (torch.float32, f32_ops)) if native
    }
    monkeypatch.setattr(small_rows, "_found", found)
    return calls


@needs_bf16_rows
def test_a_packed_product_routes_by_rows_and_switch(monkeypatch) -> None:
    calls = count_native(monkeypatch)
    weight, bias = randn(960, 576, seed=4), randn(960, seed=5)
    handle = PACKS.new_handle()
    try:
        for rows in (1, 2, 3, 16):
            x = randn(1, rows, 576, seed=rows)
            got = packed_linear_eager(x, weight, bias, handle)
            assert got.shape == (1, rows, 960)
            want = F.linear(x.double(), weight.double(), bias.double())
            assert torch.allclose(got.double(), want, rtol=2e-2, atol=2e-2)
        limit = small_rows.row_limit(960, 576, OPS.bf16_rows_amx())
        native = [rows for rows in (1, 2, 3, 16) if rows <= limit]
        assert calls == native  # more rows: oneDNN's product
        pack = PACKS._packs[handle]
        assert pack is not None and pack.rows_pack is not None
        assert PACKS.packed_bytes([handle]) == pack.nbytes > 2 * weight.numel()  # both copies counted
        monkeypatch.setenv(small_rows.ENV_SWITCH, "0")  # read when a pack first serves a product
        PACKS.invalidate(handle)
        packed_linear_eager(randn(1, 1, 576, seed=9), weight, bias, handle)
        assert calls == native
        monkeypatch.delenv(small_rows.ENV_SWITCH)
        PACKS.invalidate(handle)
        with torch.no_grad():
            weight.mul_(-1)  # a new pack, and a new row pack with it
        flipped = packed_linear_eager(randn(1, 1, 576, seed=1), weight, None, handle)
        want = F.linear(randn(1, 1, 576, seed=1).double(), weight.double())
        assert torch.allclose(flipped.double(), want, rtol=2e-2, atol=2e-2)
        assert calls == [*native, 1]
    finally:
        PACKS.drop(handle)


@needs_f32_rows
@pytest.mark.parametrize("shape", [(960, 576), (100, 71), (7, 33), (48, 40), (33, 2)])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 17, 32, 47, 64])
@pytest.mark.parametrize("with_bias", [True, False])
def test_float32_loop_is_float32_sums(shape: tuple[int, int], rows: int, with_bias: bool) -> None:
    out_features, in_features = shape
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(out_features, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator) if with_bias else None
    x = torch.randn(rows, in_features, generator=generator)
    got = F32_OPS.f32_rows_matmul(x, small_rows.pack_rows_f32(weight), bias, out_features)
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    # a chain of float32 fused multiply-adds: each step rounds once (2^-24 of the running magnitude)
    exact = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    magnitude = x.double().abs() @ weight.double().abs().T + (0 if bias is None else bias.double().abs())
    assert ((got.double() - exact).abs() <= magnitude * (in_features + 1) * 2**-24).all()


def fma_chain(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T as one float32 fused multiply-add per k, in order: float64 holds each product exactly, and
    its sum rounds to float32 as a fused multiply-add does (a float64 sum that lands on a float32 halfway point,
    which would round twice, is rare enough not to occur in these sizes)."""
    sums = torch.zeros(x.shape[0], weight.shape[0], dtype=torch.float32)
    for k in range(x.shape[1]):
        sums = (x[:, k, None].double() * weight[None, :, k].double() + sums.double()).float()
    return sums


@needs_f32_rows
@pytest.mark.parametrize("in_features", [300, 576])
@pytest.mark.parametrize("rows", [1, 7, 16, 33])
def test_float32_loop_is_one_fused_chain_per_column(in_features: int, rows: int) -> None:
    # K runs in stretches on AVX2 and rows in tiles of varying size: neither may change a column's bits
    generator = torch.Generator().manual_seed(in_features + rows)
    weight = torch.randn(40, in_features, generator=generator)
    x = torch.randn(rows, in_features, generator=generator)
    got = F32_OPS.f32_rows_matmul(x, small_rows.pack_rows_f32(weight), None, 40)
    assert torch.equal(got, fma_chain(x, weight))


@needs_f32_rows
def test_float32_routes_by_rows(monkeypatch) -> None:
    calls = count_native(monkeypatch)
    handle = PACKS.new_handle()
    try:
        weight = torch.randn(64, 32)
        limit = small_rows.row_limit(
            64, 32, small_rows._amx(F32_OPS, torch.float32), torch.float32, small_rows._lanes(F32_OPS)
        )
        for rows in (1, limit, limit + 1):
            x = torch.randn(1, rows, 32)
            got = packed_linear_eager(x, weight, None, handle)
            assert torch.allclose(got, F.linear(x, weight), rtol=1e-4, atol=1e-4)
        assert calls == [-1, -limit]  # more rows: oneDNN's product
        pack = PACKS._packs[handle]
        assert pack is not None and pack.rows_pack is not None and pack.rows_pack.dtype == torch.float32
        assert PACKS.packed_bytes([handle]) == pack.nbytes >= 2 * weight.numel() * 4  # both copies counted
    finally:
        PACKS.drop(handle)


def packed_run(model, seed: int) -> tuple[list[list[int]], dict]:
    """(prompts, outputs) of a greedy packed run of three prompts, 8 new tokens each."""
    prompts = prompts_of_lengths([5, 17, 30], seed=seed)
    outputs = model.generate_batch(
        prompts,
        max_new_tokens=8,
        continuous_batching_config=ContinuousBatchingConfig(page_size=16, packed_linear=True),
        progress_bar=False,
    )
    return prompts, outputs


@needs_f32_rows
def test_float32_run_equals_generate_with_the_small_row_product(monkeypatch) -> None:
    monkeypatch.setenv(RULE_ENV, "all")  # every float32 weight packed from one row (not the measured rule)
    calls = count_native(monkeypatch)
    model = tiny_llama()
    prompts, outputs = packed_run(model, seed=4)
    # rows of the three requests' decode steps and LM heads (1-3; the prompts are 5-30 tokens)
    assert any(-3 <= rows <= -1 for rows in calls), "no decode step took the float32 small-row product"
    for i, prompt in enumerate(prompts):
        assert outputs[f"req_{i}"].generated_tokens == greedy_reference(model, prompt, 8)


@needs_bf16_rows
def test_bf16_run_like_generate_with_the_small_row_product(monkeypatch) -> None:
    calls = count_native(monkeypatch)
    model = tiny_llama().to(torch.bfloat16)
    prompts, outputs = packed_run(model, seed=3)
    assert any(1 <= rows <= 3 for rows in calls), "no decode step took the small-row product"
    for i, prompt in enumerate(prompts):
        tokens = outputs[f"req_{i}"].generated_tokens
        mismatch = compare_tokens(model, f"req_{i}", prompt, greedy_reference(model, prompt, 8), tokens)
        assert mismatch is None or mismatch.is_near_tie, mismatch.describe()


@needs_bf16_rows
def test_native_loop_takes_strided_rows_and_bias() -> None:
    weight, wide = randn(40, 64, seed=1), randn(3, 128, seed=2)
    bias = randn(80, seed=3)[::2]  # a strided bias, as a column slice of another tensor would be
    pack = small_rows.pack_rows(weight)
    strided = OPS.bf16_rows_matmul(wide[:, ::2], pack, bias, 40)
    assert torch.equal(strided, OPS.bf16_rows_matmul(wide[:, ::2].contiguous(), pack, bias.contiguous(), 40))


@needs_bf16_rows
@pytest.mark.parametrize("shape", [(20000, 64), (96, 64), (96, 48)])
def test_the_memory_check_counts_a_row_pack_exactly_where_one_is_made(shape: tuple[int, int]) -> None:
    """`has_rows_pack` (what the memory check counts) follows `row_pack_for`'s rule on this CPU, an LM head's
    width (over `MAX_COLUMNS`, native only without AMX) included."""
    pack = SimpleNamespace(packed=torch.zeros(shape, dtype=torch.bfloat16), rows_pack=None, row_limit=None)
    made = small_rows.row_pack_for(pack, torch.bfloat16, 1) is not None
    assert small_rows.has_rows_pack(*shape) == made


@needs_bf16_rows
def test_on_an_amx_cpu_the_memory_check_counts_no_row_pack_for_an_lm_head(monkeypatch) -> None:
    """With AMX tiles a bf16 LM head keeps oneDNN's product, so no row pack is made nor counted."""
    amx_ops = SimpleNamespace(bf16_rows_amx=lambda: True)
    monkeypatch.setattr(small_rows, "rows_module", lambda dtype=torch.bfloat16: amx_ops)
    pack = SimpleNamespace(
        packed=torch.zeros(20000, 64, dtype=torch.bfloat16), rows_pack=None, row_limit=None
    )
    assert small_rows.row_pack_for(pack, torch.bfloat16, 1) is None
    assert not small_rows.has_rows_pack(20000, 64)
    assert small_rows.has_rows_pack(3072, 576)  # a layer's weight: AMX tiles from the library
