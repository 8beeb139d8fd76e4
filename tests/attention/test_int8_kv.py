"""The int8 KV cache's unit reference (docs/quantization.md, "int8 KV cache"): attention over int8 pages
equals the float attention (the reference kernel, float32) over the K/V those pages dequantize to, within
float tolerance, on every path that reads them: the native kernel (its AVX-512 int8 instance for head sizes
64 / 128, its portable one elsewhere), and the torch paths (sdpa, eager) that dequantize what they gather;
decode rows and prefill chunks (first chunks, chunks starting mid-page, long chunks past the native
bound), several page sizes, GQA and MQA. The write path is checked too: every new token's K/V is in the
pages as `quantize` makes it, with its scales, and nothing else changed."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from conformance.common import TOLERANCES, assert_close
from tests.support.packed_steps import KernelStep, build_kernel_step
from transformers_cb.attention.backends.eager import eager_attend
from transformers_cb.attention.backends.sdpa import sdpa_attend
from transformers_cb.attention.native import kernel as native
from transformers_cb.attention.paged import native_paged_attention_op, paged_attention
from transformers_cb.attention.reference import reference_paged_attention
from transformers_cb.memory.kv_cache import scale_views
from transformers_cb.memory.kv_quant import dequantize, quantize, round_trip

ATTENDS = {"sdpa": sdpa_attend, "eager": eager_attend, "native": sdpa_attend}
# (H, Hkv, D): MHA on the portable path, GQA 4 and MQA on the vector kernel's 64 / 128, GQA 2 at 32.
HEADS = [(4, 4, 16), (8, 2, 64), (6, 1, 128), (4, 2, 32)]
CASES = {
    "decodes": lambda p: [(0, 1), (p - 1, 1), (2 * p, 1), (5 * p + 3, 1)],
    "mixed": lambda p: [(3, 1), (0, 2 * p + 3), (p + 3, p + 2), (40, 1), (2 * p, p), (0, 1)],
    "long_chunk": lambda p: [(3, 1), (p, 530), (50, 1)],  # past the native bound: torch after the run
}


def int8_step(case: str, page_size: int, heads: tuple[int, int, int], dtype: torch.dtype, kernel: str):
    if kernel == "native" and native.ensure_native_module() is None:
        pytest.skip("the native CPU kernel cannot be built here (see the logged reason)")
    num_heads, num_kv_heads, head_dim = heads
    seqs = CASES[case](page_size)
    return build_kernel_step(
        seqs,
        page_size,
        num_heads,
        num_kv_heads,
        head_dim,
        dtype=dtype,
        seed=page_size + head_dim,
        native=kernel == "native",
        kv_dtype=torch.int8,
    )


def dequantized_layer(step: KernelStep) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole layer's K and V as the int8 pages and their scales give them back, in float32."""
    keys, values = step.cache.layer(0)
    key_scales, value_scales = step.cache.layer_scales(0)  # type: ignore[misc]
    return dequantize(keys, key_scales, torch.float32), dequantize(values, value_scales, torch.float32)


def dequantized_reference(step: KernelStep, **options: object) -> torch.Tensor:
    """The float32 reference attention of `step`'s queries over its layer's K/V as the int8 pages give them back
    (`options`: the reference's window, softcap, sinks, ALiBi)."""
    k_float, v_float = dequantized_layer(step)
    metadata = step.metadata
    return reference_paged_attention(
        step.query[0].transpose(0, 1).float(),
        k_float,
        v_float,
        metadata.cu_seqlens_q,
        metadata.seq_lens_k,
        metadata.groups[0].block_table,
        step.page_size,
        step.scale,
        **options,
    )


def check_written(step: KernelStep, before: tuple[torch.Tensor, ...]) -> None:
    """Each new token's K/V at its slots, quantized as `quantize` makes it; every other slot untouched."""
    keys, values = step.cache.layer(0)
    key_scales, value_scales = step.cache.layer_scales(0)  # type: ignore[misc]
    assert keys.dtype == values.dtype == torch.int8 and key_scales.dtype == torch.float32
    new_keys, new_values = step.key[0].transpose(0, 1), step.value[0].transpose(0, 1)
    written = torch.zeros(keys.shape[0], dtype=torch.bool)
    cu = step.metadata.cu_seqlens_q.tolist()
    for row, i in enumerate(step.packed_order):
        past, q = step.seqs[i]
        slots = step.slots(i, past + q)[past:]
        for cache, scales, new in ((keys, key_scales, new_keys), (values, value_scales, new_values)):
            expected_q, expected_scale = quantize(new[cu[row] : cu[row + 1]])
            assert torch.equal(cache[slots], expected_q) and torch.equal(scales[slots], expected_scale)
        written[slots] = True
    for now, then in zip((keys, values, key_scales, value_scales), before, strict=True):
        assert torch.equal(now[~written], then[~written]), "the step wrote outside its new tokens' slots"


@pytest.mark.parametrize("kernel", sorted(ATTENDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"H{h[0]}-Hkv{h[1]}-D{h[2]}")
@pytest.mark.parametrize("page_size", [4, 16, 32])
@pytest.mark.parametrize("case", sorted(CASES))
def test_int8_pages_attend_like_float_attention_over_their_dequantized_kv(
    case: str, page_size: int, heads: tuple[int, int, int], dtype: torch.dtype, kernel: str
) -> None:
    step = int8_step(case, page_size, heads, dtype, kernel)
    keys, values = step.cache.layer(0)
    before = (keys.clone(), values.clone(), *(t.clone() for t in step.cache.layer_scales(0)))  # type: ignore[union-attr]
    out = paged_attention(step.query, step.key, step.value, 0, step.metadata, step.scale, ATTENDS[kernel])
    check_written(step, before)
    if kernel == "native":  # the kernel read the int8 pages itself for the decodes and short chunks
        short = sum(q for _, q in step.seqs if q < 530)
        assert step.metadata.native_tokens == short
    expected = dequantized_reference(step)
    atol, rtol = TOLERANCES[dtype]
    assert out.dtype == dtype
    assert_close(out[0].float(), expected, atol, rtol, msg=f"{kernel} int8 {case} page {page_size} {heads}")


def test_quantize_zero_rows_read_back_zero_and_the_error_is_half_a_step() -> None:
    rows = torch.randn(5, 3, 64, generator=torch.Generator().manual_seed(0)) * 4
    rows[1, 2] = 0.0  # a zero row: scale 1, no NaN
    q, scale = quantize(rows)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (5, 3)
    assert scale[1, 2] == 1.0 and torch.equal(q[1, 2], torch.zeros(64, dtype=torch.int8))
    assert int(q.abs().max()) == 127  # each row's largest value uses the whole range
    back = dequantize(q, scale, torch.float32)
    assert torch.isfinite(back).all() and torch.equal(back[1, 2], torch.zeros(64))
    assert ((back - rows).abs() <= scale.unsqueeze(-1) / 2 + 1e-6).all()
    assert torch.equal(round_trip(rows), back)
    zeros = torch.zeros(2, 2, 8)  # zero-filled pages nothing wrote (scale 0 there) read back 0 too
    assert torch.equal(dequantize(zeros.to(torch.int8), torch.zeros(2, 2), torch.float32), zeros)


def test_native_op_writes_int8_pages_and_scales_and_passes_opcheck() -> None:
    """The custom op a compiled forward keeps: an int8 group tensor with its scales, both mutated."""
    if native.native_module() is None:
        pytest.skip("the native CPU kernel cannot be built here (see the logged reason)")
    gen = torch.Generator().manual_seed(1)
    layers, pages, page, kv_heads, dim = 2, 6, 4, 2, 64
    storage = torch.zeros(2, layers, pages, page, kv_heads, dim, dtype=torch.int8)
    scales = torch.zeros(2, layers, pages, page, kv_heads)
    block_table = torch.tensor([[0, 2], [3, 3]], dtype=torch.int32)
    prompt = torch.randn(2, 6, kv_heads, dim, generator=gen)
    for layer in range(layers):  # row 0 holds 5 tokens, row 1 two: written as the kernel's writes would
        k_cache, v_cache = (
            storage[0, layer].view(-1, kv_heads, dim),
            storage[1, layer].view(-1, kv_heads, dim),
        )
        k_scale, v_scale = scale_views(scales, layer)
        for cache, scale_cache, rows in ((k_cache, k_scale, prompt[0]), (v_cache, v_scale, prompt[1])):
            slots = torch.tensor([0, 1, 2, 3, 8, 12, 13])
            q, s = quantize(rows.repeat(2, 1, 1)[:7])
            cache[slots], scale_cache[slots] = q, s
    query = torch.randn(2, 8, dim, generator=gen)
    new_k, new_v = torch.randn(2, kv_heads, dim, generator=gen), torch.randn(2, kv_heads, dim, generator=gen)
    slots = torch.tensor([2 * page + 1, 3 * page + 2])
    args = (query, new_k, new_v, storage, 1, slots, torch.tensor([0, 1]), torch.tensor([5, 2]), block_table)
    torch.library.opcheck(
        native_paged_attention_op, (*args, page, 0.125, 0, 0.0, None, None, scales.clone()), {}
    )
    out = native_paged_attention_op(*args, page, 0.125, 0, 0.0, None, None, scales)
    k_cache, v_cache = storage[0, 1].view(-1, kv_heads, dim), storage[1, 1].view(-1, kv_heads, dim)
    k_scale, v_scale = scale_views(scales, 1)
    assert torch.equal(k_cache[slots], quantize(new_k)[0]) and torch.equal(v_scale[slots], quantize(new_v)[1])
    expected = reference_paged_attention(
        query,
        dequantize(k_cache, k_scale, torch.float32),
        dequantize(v_cache, v_scale, torch.float32),
        torch.tensor([0, 1, 2]),
        torch.tensor([6, 3]),
        block_table,
        page,
        0.125,
    )
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_native_write_quantizes_bit_for_bit_like_the_torch_write(dtype: torch.dtype) -> None:
    """The library's `write_int8_rows` against `write_slots` (kv_quant.quantize): strided rows, a zero row,
    values exactly half-way between two steps (rounded half to even by both), at scattered slots."""
    module = native.ensure_native_module()
    if module is None:
        pytest.skip("the native CPU kernel cannot be built here (see the logged reason)")
    gen = torch.Generator().manual_seed(3)
    rows = (torch.randn(2, 7, 64, generator=gen) * 3).to(dtype).transpose(0, 1)  # [T=7, Hkv=2, D], strided
    rows[2, 1] = 0
    rows[4, 0] = torch.cat([torch.tensor([127.0]), torch.arange(-31.5, 31.0, 1.0)]).to(
        dtype
    )  # scale 1: halves
    slots = torch.tensor([9, 0, 4, 15, 3, 11, 6])
    caches = [[torch.zeros(16, 2, 64, dtype=torch.int8) for _ in range(2)] for _ in range(2)]
    scales = [[torch.zeros(16, 2) for _ in range(2)] for _ in range(2)]
    native.write_pages(*caches[0], slots, rows, rows * 2, tuple(scales[0]))  # type: ignore[arg-type]
    with mock.patch.object(native, "native_module", lambda: None):
        native.write_pages(*caches[1], slots, rows, rows * 2, tuple(scales[1]))  # type: ignore[arg-type]
    for mine, theirs in zip(caches[0] + scales[0], caches[1] + scales[1], strict=True):
        assert torch.equal(mine, theirs)
    assert scales[0][0][4, 1] == 1.0 and scales[0][0][3, 0] == 1.0  # the zero row; the halves' row
    assert caches[0][0][3, 0, 1:5].tolist() == [-32, -30, -30, -28]  # -31.5, -30.5, -29.5, -28.5: to even


@pytest.mark.parametrize("kernel", sorted(ATTENDS))
@pytest.mark.parametrize("head_dim", [64, 32])
def test_int8_pages_with_a_window_softcap_and_sinks(kernel: str, head_dim: int) -> None:
    """A sliding layer (its pages trimmed to the window) with a logit softcap and attention sinks: the same
    reference over the dequantized K/V."""
    if kernel == "native" and native.ensure_native_module() is None:
        pytest.skip("the native CPU kernel cannot be built here (see the logged reason)")
    seqs = [(3, 1), (30, 1), (0, 13), (9, 6), (21, 1)]
    step = build_kernel_step(
        seqs, 4, 8, 2, head_dim, seed=11, sliding_window=8, native=kernel == "native", kv_dtype=torch.int8
    )
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(4))
    out = paged_attention(
        step.query, step.key, step.value, 0, step.metadata, step.scale, ATTENDS[kernel], 30.0, sinks
    )
    if kernel == "native":
        assert step.metadata.native_tokens == sum(q for _, q in seqs)
    expected = dequantized_reference(step, sliding_window=8, softcap=30.0, sinks=sinks)
    assert_close(out[0], expected, *TOLERANCES[torch.float32], msg=f"{kernel} int8 sliding D={head_dim}")


def test_int8_pages_under_an_alibi_form_the_kernel_does_not_add() -> None:
    """Falcon's ALiBi form: the native run's tokens go through `attend` row by row (`_attend_native_rows`),
    gathering dequantized K/V; the reference adds the same form over the dequantized K/V."""
    from transformers_cb.attention.families.alibi import FALCON_FORM, bloom_slopes

    if native.ensure_native_module() is None:
        pytest.skip("the native CPU kernel cannot be built here (see the logged reason)")
    seqs = [(3, 1), (30, 1), (0, 13), (9, 6)]
    step = build_kernel_step(seqs, 4, 8, 2, 32, seed=12, native=True, kv_dtype=torch.int8)
    slopes = bloom_slopes(8)
    out = paged_attention(
        step.query,
        step.key,
        step.value,
        0,
        step.metadata,
        step.scale,
        eager_attend,
        None,
        None,
        slopes,
        FALCON_FORM,
    )
    assert step.metadata.native_tokens == sum(q for _, q in seqs)
    expected = dequantized_reference(step, slopes=slopes, alibi_form=FALCON_FORM)
    assert_close(out[0], expected, *TOLERANCES[torch.float32], msg="int8 pages, Falcon's ALiBi form")
