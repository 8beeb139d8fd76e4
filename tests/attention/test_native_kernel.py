"""The native CPU paged-attention kernel in the engine: used when built, same tokens as generate()
with it and without it (float32, and bf16 / fp16 against generate() in that dtype), one attention call
per layer however many short requests a step holds, and a clean fall-back when it cannot be built.
Building it (folders, locks, a missing compiler across processes) is tests/attention/test_native_build.py. The kernel's numerics against the reference kernel
are in conformance/test_kernels.py (the "native" cases)."""

from __future__ import annotations

import logging
from contextlib import contextmanager
from unittest import mock

import pytest
import torch

from conformance.common import ReferenceCache, check_parity, greedy_config, run_batch
from tests.support.models import backends_for, build_tiny_model, using_backend, vocab_size
from tests.support.prompts import random_prompts
from transformers_cb.attention import paged
from transformers_cb.attention.native import kernel as native
from transformers_cb.memory.kv_cache import PagedKVCache
from transformers_cb.runner.model_runner import ModelRunner
from transformers_cb.runner.packing import BatchPacker

pytestmark = pytest.mark.skipif(
    native.ensure_native_module() is None,
    reason="the native CPU kernel cannot be built here (see the logged reason)",
)

MAX_NEW_TOKENS = 8


@pytest.fixture(autouse=True)
def through_the_paged_glue(monkeypatch: pytest.MonkeyPatch) -> None:
    # These tests count the glue's calls of the kernel: a Llama layer's direct step
    # (runner/layer_ops/direct_layer.py, tests/runner/test_direct_layer.py) would call it from native code.
    monkeypatch.setenv("TRANSFORMERS_CB_DIRECT_LAYERS", "0")


@contextmanager
def counting_calls():
    """Count the native kernel's calls and SDPA's (what the paged glue's per-group calls end in)."""
    counts = {"native": 0, "attend": 0}
    original_sdpa = torch.nn.functional.scaled_dot_product_attention
    original_native = paged.native_paged_attention

    def counted_native(*args, **kwargs):
        counts["native"] += 1
        return original_native(*args, **kwargs)

    def counted_attend(*args, **kwargs):
        counts["attend"] += 1
        return original_sdpa(*args, **kwargs)

    with (
        mock.patch.object(paged, "native_paged_attention", counted_native),
        mock.patch("torch.nn.functional.scaled_dot_product_attention", counted_attend),
    ):
        yield counts


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt_oss", "mistral"])
@pytest.mark.parametrize("switch", ["1", "0"])
def test_parity_with_and_without_the_native_kernel(family: str, switch: str, monkeypatch) -> None:
    """Full attention, sliding windows with softcaps (Gemma 2) and sinks (GPT-OSS): generate() tokens
    either way; with the switch at 0 the kernel is never called."""
    monkeypatch.setenv(native.ENV_SWITCH, switch)
    model = build_tiny_model(family, seed=0)
    prompts = random_prompts(6, vocab_size(model), 1, 90, seed=2)  # some chunks past 64 tokens
    references = ReferenceCache(model, MAX_NEW_TOKENS)
    expected = [references.get(p) for p in prompts]
    calls = mock.Mock(wraps=paged.native_paged_attention)
    with using_backend(model, family, backends_for(family)[0]) as paged_model:
        with mock.patch.object(paged, "native_paged_attention", calls):
            outputs, _ = run_batch(paged_model, prompts, greedy_config(MAX_NEW_TOKENS), page_size=16)
        check_parity(paged_model, prompts, outputs, expected, f"{family} native={switch}")
    assert (calls.call_count > 0) == (switch == "1")


def test_one_attention_call_per_layer_whatever_the_number_of_short_requests() -> None:
    """A step of N short prompts is one native call per layer, not N."""
    model = build_tiny_model("llama", seed=0)
    layers = model.config.num_hidden_layers
    for count in (4, 40):
        prompts = random_prompts(count, vocab_size(model), 8, 40, seed=count)
        steps: list = []

        def run(self, batch, counts, steps=steps, original_run=ModelRunner.run):
            before = dict(counts)
            result = original_run(self, batch)
            steps.append((len(batch.entries), {k: counts[k] - before[k] for k in counts}))
            return result

        with (
            counting_calls() as counts,
            mock.patch.object(ModelRunner, "run", lambda s, b: run(s, b, counts)),
        ):
            outputs, _ = run_batch(
                model,
                prompts,
                greedy_config(1),
                max_batch_tokens=4096,
                page_size=64,
                num_blocks=64,
                safety_margin=0.0,
            )
        assert len(outputs) == count
        # Every prompt fits the budget and needs one token: one step of all of them (after the
        # warmup's), with one native call per layer and no per-request attention call.
        assert steps[-1] == (count, {"native": layers, "attend": 0}), steps


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "gpt_oss"])
def test_low_precision_parity_through_the_native_kernel(family: str, dtype: torch.dtype) -> None:
    """bf16 / fp16 models decode through the native kernel (it reads the caches as they are and
    accumulates in float32), with generate()'s tokens in the same dtype: identical where the top-2 logit
    margin allows, otherwise a near-tie within the dtype's tolerance, continued from there (check_parity,
    as in the whole conformance suite). Uneven lengths, sliding windows with softcaps, sinks."""
    model = build_tiny_model(family, seed=0).to(dtype)
    prompts = random_prompts(8, vocab_size(model), 3, 40, seed=1)
    references = ReferenceCache(model, 24)
    expected = [references.get(p) for p in prompts]
    calls = mock.Mock(wraps=paged.native_paged_attention)
    with using_backend(model, family, backends_for(family)[0]) as paged_model:
        with mock.patch.object(paged, "native_paged_attention", calls):
            outputs, _ = run_batch(
                paged_model, prompts, greedy_config(24), page_size=16, max_batch_tokens=256
            )
        check_parity(paged_model, prompts, outputs, expected, f"{family} {dtype} native")
    assert calls.call_count > 0
    assert all(call.args[0].dtype == dtype and call.args[1].dtype == dtype for call in calls.call_args_list)


def test_failed_build_falls_back_to_the_python_kernels(monkeypatch, caplog) -> None:
    """In-process: no compiler (a CXX that does not exist), so no kernel folder, one warning, the
    torch kernels, generate()'s tokens."""
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv("CXX", "/nonexistent/bin/c++")
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        assert native.native_module() is None
        assert native.native_module() is None
        assert native.ensure_native_module() is None
    assert caplog.text.count("native CPU paged-attention kernel unavailable (no C++ compiler") == 1, (
        caplog.text
    )
    cache = PagedKVCache(1, 4, 4, 2, 8, torch.float32, torch.device("cpu"))
    assert not BatchPacker(cache, 2, torch.device("cpu")).native
    model = build_tiny_model("llama", seed=0)
    prompts = random_prompts(3, vocab_size(model), 1, 20, seed=3)
    references = ReferenceCache(model, 4)
    outputs, _ = run_batch(model, prompts, greedy_config(4))
    check_parity(model, prompts, outputs, [references.get(p) for p in prompts], "fallback")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_native_kernel_takes_every_float_dtype(dtype: torch.dtype) -> None:
    cache = PagedKVCache(1, 4, 4, 2, 8, dtype, torch.device("cpu"))
    assert BatchPacker(cache, 2, torch.device("cpu")).native


def test_native_required_where_it_cannot_run_is_an_error() -> None:
    cache = PagedKVCache(1, 4, 4, 2, 8, torch.float64, torch.device("cpu"))
    assert not BatchPacker(cache, 2, torch.device("cpu")).native  # float64: the Python kernels
    with pytest.raises(
        ValueError, match="native paged-attention kernel cannot run on cpu with torch.float64"
    ):
        BatchPacker(cache, 2, torch.device("cpu"), native=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sharp_rows_whose_probabilities_are_subnormal_attend_like_the_reference(dtype: torch.dtype) -> None:
    # Logits ~100 apart put most probabilities below 2^-126: the kernel flushes them (a 2-4x slowdown
    # otherwise, docs/design.md) and must still agree with the reference, and leave the caller's
    # floating-point mode as it was.
    from transformers_cb.attention.reference import reference_paged_attention

    if native.ensure_native_module() is None:
        pytest.skip("the native kernel cannot be built here")
    gen = torch.Generator().manual_seed(0)
    tokens, heads, kv_heads, dim, page, kv_len = 4, 8, 2, 64, 16, 40
    query = (torch.randn(tokens, heads, dim, generator=gen) * 40).to(dtype)
    keys = torch.randn(4 * page, kv_heads, dim, generator=gen).to(dtype)
    values = torch.randn(4 * page, kv_heads, dim, generator=gen).to(dtype)
    block_table = torch.tensor([[2, 0, 3, 1]], dtype=torch.int32)
    positions = torch.arange(kv_len - tokens, kv_len)
    out = torch.empty_like(query)
    native.native_paged_attention(
        query,
        keys,
        values,
        torch.zeros(tokens, dtype=torch.long),
        positions,
        block_table,
        page,
        0.125,
        None,
        None,
        None,
        out,
    )
    expected = reference_paged_attention(
        query.float(),
        keys.float(),
        values.float(),
        torch.tensor([0, tokens]),
        torch.tensor([kv_len]),
        block_table,
        page,
        0.125,
    )
    scores = torch.einsum("thd,khd->thk", query.float()[:, :2], keys.float()[:kv_len, :1]) * 0.125
    assert (scores.max(-1).values - scores.min(-1).values).min() > 100  # the test's rows are that sharp
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2  # logits of ~500: their own ulp is ~3e-5
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)
    subnormal = torch.tensor([1e-39], dtype=torch.float32)
    assert (subnormal * 1.0).item() != 0.0  # this thread still computes subnormals


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (8, 2, 128), (4, 4, 64), (8, 1, 64)])
@pytest.mark.parametrize("variant", ["plain", "window", "softcap", "sinks"])
def test_tokens_attended_together_get_the_bits_each_gets_alone(dtype, heads, kv_heads, dim, variant) -> None:
    """A step of several tokens takes the by-token kernel (every KV head of a token in one pass over its
    keys); a single token takes the per-head kernel. Same arithmetic in the same order: the same bits, for
    key counts below, at and past a 16-key block and with a partial last block."""
    gen = torch.Generator().manual_seed(1)
    page, pages_per_row = 16, 8
    kv_lens = [1, 15, 16, 17, 40, 100, 127]
    rows = len(kv_lens)
    slots = rows * pages_per_row * page
    keys = torch.randn(slots, kv_heads, dim, generator=gen).to(dtype)
    values = torch.randn(slots, kv_heads, dim, generator=gen).to(dtype)
    query = (torch.randn(rows, heads, dim, generator=gen) * 3).to(dtype)
    block_table = (
        torch.randperm(rows * pages_per_row, generator=gen).to(torch.int32).view(rows, pages_per_row)
    )
    token_row = torch.arange(rows)
    token_pos = torch.tensor(kv_lens) - 1
    window = 24 if variant == "window" else None
    softcap = 5.0 if variant == "softcap" else None
    sinks = torch.randn(heads, generator=gen) if variant == "sinks" else None

    def attend(index: slice) -> torch.Tensor:
        out = torch.empty_like(query[index])
        native.native_paged_attention(
            query[index], keys, values, token_row[index], token_pos[index], block_table, page, dim**-0.5,
            window, softcap, sinks, out,
        )  # fmt: skip
        return out

    _together_equals_alone(attend, rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (8, 2, 128), (4, 4, 64), (16, 2, 64)])
@pytest.mark.parametrize("variant", ["plain", "softcap", "sinks", "alibi", "window"])
def test_a_prefill_chunk_in_query_tiles_gets_the_bits_each_token_gets_alone(
    dtype, heads, kv_heads, dim, variant
) -> None:
    """A prefill chunk's tokens share each widened K/V block in query tiles of up to 16 (the tile kernel,
    attention/native/native_vec_source.py); each token keeps the per-token kernel's arithmetic and order, so
    the chunk gets the same bits as its tokens attended one by one (the prompt the same bits however it is
    chunked), and both match a float64 reference. Chunks from position 0 and from mid-prompt, a partial
    last tile, a lone decode between chunks; on one thread and two."""
    if native.native_module() is None or not native.vector_kernels():
        pytest.skip("the AVX-512 kernels are not built here")
    gen = torch.Generator().manual_seed(2)
    page, pages_per_row = 16, 24
    chunks = [(0, 0, 37), (1, 100, 50), (2, 7, 1), (3, 300, 16), (4, 15, 18)]  # (row, first position, tokens)
    rows = len(chunks)
    keys = torch.randn(rows * pages_per_row * page, kv_heads, dim, generator=gen).to(dtype)
    values = torch.randn(rows * pages_per_row * page, kv_heads, dim, generator=gen).to(dtype)
    block_table = (
        torch.randperm(rows * pages_per_row, generator=gen).to(torch.int32).view(rows, pages_per_row)
    )
    token_row = torch.tensor([row for row, _, n in chunks for _ in range(n)])
    token_pos = torch.tensor([p for _, start, n in chunks for p in range(start, start + n)])
    query = (torch.randn(len(token_row), heads, dim, generator=gen) * 3).to(dtype)
    window = 24 if variant == "window" else None
    softcap = 5.0 if variant == "softcap" else None
    sinks = torch.randn(heads, generator=gen) if variant == "sinks" else None
    slopes = torch.rand(heads, generator=gen) * 0.1 if variant == "alibi" else None

    def attend(index: slice) -> torch.Tensor:
        out = torch.empty_like(query[index])
        native.native_paged_attention(
            query[index], keys, values, token_row[index], token_pos[index], block_table, page, dim**-0.5,
            window, softcap, sinks, out, slopes,
        )  # fmt: skip
        return out

    together = _together_equals_alone(attend, len(token_row))
    expected = _reference_attention(
        query,
        keys,
        values,
        token_row,
        token_pos,
        block_table,
        page,
        dim**-0.5,
        window,
        softcap,
        sinks,
        slopes,
    )
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(together.double(), expected, atol=tolerance, rtol=tolerance)


def _reference_attention(query, keys, values, token_row, token_pos, block_table, page, scale, window, softcap,
                         sinks, slopes) -> torch.Tensor:  # fmt: skip
    """Each token's attention over its row's keys in float64, written out (the kernel's definition)."""
    heads, group = query.shape[1], query.shape[1] // keys.shape[1]
    out = torch.empty(query.shape, dtype=torch.float64)
    for t, (row, pos) in enumerate(zip(token_row.tolist(), token_pos.tolist(), strict=True)):
        first = max(0, pos - window + 1) if window else 0
        positions = torch.arange(first, pos + 1)
        slots = block_table[row, positions // page].long() * page + positions % page
        k = keys[slots].double().repeat_interleave(group, dim=1)  # [L, H, D]
        v = values[slots].double().repeat_interleave(group, dim=1)
        logits = torch.einsum("hd,lhd->hl", query[t].double(), k) * scale
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        if slopes is not None:
            logits = logits + slopes.double()[:, None] * (positions - pos).double()[None, :]
        if sinks is not None:
            logits = torch.cat([logits, sinks.double().view(heads, 1)], dim=1)
        probs = torch.softmax(logits, dim=1)[:, : len(positions)]
        out[t] = torch.einsum("hl,lhd->hd", probs, v)
    return out


def _together_equals_alone(attend, count: int) -> torch.Tensor:
    """`attend(slice)` of all `count` tokens in one call, checked bitwise equal to each token's own call, on one
    thread and on two; returns the one call's output."""
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            together = attend(slice(0, count))
            alone = torch.cat([attend(slice(t, t + 1)) for t in range(count)])
            assert torch.equal(together, alone), (n, (together.float() - alone.float()).abs().max())
    finally:
        torch.set_num_threads(threads)
    return together
