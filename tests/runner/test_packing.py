"""`BatchPacker`'s step layout (runner/packing.py): which rows the native kernel runs, and how decodes are
grouped (every decode once, in order, within the padding bound, never reading another request's KV)."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.packed_steps import build_kernel_step
from transformers_cb.attention.native.kernel import ensure_native_module
from transformers_cb.kv.layer_groups import FULL_ATTENTION, KVGroupSpec
from transformers_cb.memory.kv_cache import CacheLayout
from transformers_cb.runner.call_groups import (
    AVX2_CHUNK_MAX_WORK,
    AVX2_WIDE_HEAD_CHUNK_MAX_WORK,
    DECODE_PADDING_BOUND,
    group_decodes,
    native_chunk_max_work,
    native_prefill_max_work,
    native_takes_every_chunk,
)

P = 8  # page size of the hand-written step


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_native_run_covers_decodes_and_short_chunks_only(dtype) -> None:
    """The native run is the decodes plus the chunks up to `native_prefill_max_work(dtype)` pairs; the long
    chunks after it keep their own groups, and no decode group is built."""
    if ensure_native_module() is None:
        pytest.skip("the native CPU kernel cannot be built here (see the logged reason)")
    bound = native_prefill_max_work(dtype)
    long = 520 if dtype == torch.float32 else 130  # over the bound from an empty cache
    seqs = [(3, 1), (0, long), (10, 5), (P, long + 10), (50, 1), (0, 2)]  # two chunks over the bound
    step = build_kernel_step(seqs, P, 8, 2, 16, dtype=dtype, native=True)
    metadata = step.metadata
    assert 5 * 15 < bound < long * long
    assert metadata.native_tokens == 1 + 5 + 1 + 2
    assert not metadata.groups[0].decode_groups
    first, second = (9, 9 + long), (9 + long, 9 + 2 * long + 10)
    assert [(g.q_start, g.q_end) for g in metadata.groups[0].prefill_groups] == [first, second]
    rows = [step.packed_order[r] for r in metadata.token_row.tolist()]
    assert [step.seqs[i] for i in rows] == [(50, 1), (3, 1)] + [(10, 5)] * 5 + [(0, 2)] * 2
    assert metadata.token_pos.tolist() == [50, 3, 10, 11, 12, 13, 14, 0, 1]


def test_the_native_bound_is_wider_in_float32() -> None:
    """float32 chunks up to 512 tokens join the native call (the AVX-512 kernel beats SDPA there); lower
    precision keeps SDPA's blocked kernel from 128."""
    assert native_prefill_max_work(torch.float32) == 512 * 512
    assert native_prefill_max_work(torch.bfloat16) == native_prefill_max_work(torch.float16) == 128 * 128


def test_every_chunk_joins_the_native_call_where_the_query_tiles_take_the_shape() -> None:
    """Chunks of any length join the native call where the vector kernel (and its query tiles) takes every
    layer's head size and group: float32 anywhere, bfloat16 without AMX (whose SDPA products run on AMX)."""

    def takes(dtype, head_dims, group, vector_kernels, amx, **group_spec) -> bool:
        groups = tuple(
            KVGroupSpec(FULL_ATTENTION, (i,), head_shape=(2, d), **group_spec)
            for i, d in enumerate(head_dims)
        )
        layout = CacheLayout(len(groups), groups, (8,) * len(groups), 16, 2, 64, dtype, torch.device("cpu"))
        return native_takes_every_chunk(layout, group, vector_kernels, amx)

    assert takes(torch.bfloat16, [64], 4, vector_kernels=True, amx=False)
    assert takes(torch.float32, [64, 128], 8, vector_kernels=True, amx=True)
    assert not takes(torch.bfloat16, [64], 4, vector_kernels=True, amx=True)
    assert not takes(torch.float16, [64], 4, vector_kernels=True, amx=False)  # no vector kernel for fp16
    assert not takes(torch.float32, [64], 4, vector_kernels=False, amx=False)  # no vector kernel built
    assert not takes(torch.float32, [64, 96], 4, vector_kernels=True, amx=False)
    assert not takes(torch.float32, [64], 9, vector_kernels=True, amx=False)
    assert not takes(
        torch.float32, [64], 4, vector_kernels=True, amx=False, value_dim=32
    )  # V of another size


def test_long_chunks_join_the_native_call_up_to_the_bound_measured_for_the_kernels_width() -> None:
    """AVX-512 tiles take every chunk; AVX2's (8 lanes) up to 1024 x 1024 (query, key) pairs for heads of 64,
    512 x 512 where a layer's heads are wider (SDPA won past those)."""

    def layout(*head_dims: int) -> CacheLayout:
        groups = tuple(KVGroupSpec(FULL_ATTENTION, (i,), head_shape=(2, d)) for i, d in enumerate(head_dims))
        return CacheLayout(
            len(groups), groups, (8,) * len(groups), 16, 2, 64, torch.float32, torch.device("cpu")
        )

    assert native_chunk_max_work(layout(64, 128), 4, 16, False) == sys.maxsize
    assert native_chunk_max_work(layout(64), 4, 8, False) == AVX2_CHUNK_MAX_WORK == 1024 * 1024
    assert native_chunk_max_work(layout(64, 128), 4, 8, False) == AVX2_WIDE_HEAD_CHUNK_MAX_WORK == 512 * 512
    assert native_chunk_max_work(layout(64), 4, 0, False) == 0  # no vector kernel built
    assert native_chunk_max_work(layout(64), 9, 8, False) == 0  # a group the tiles do not take


def test_the_packer_keeps_every_chunk_native_in_batch_invariant_mode_on_any_width(monkeypatch) -> None:
    """`every_long_chunk_native` only raises the bound: after `every_chunk_native` (batch-invariant mode) an AVX2
    library's bound must not bring SDPA back for long chunks."""
    from transformers_cb.runner import packing

    packer = SimpleNamespace(
        native=True, cache=SimpleNamespace(layout=None), native_prefill_max_work=sys.maxsize
    )
    monkeypatch.setattr(packing, "vector_lanes", lambda: 8)
    monkeypatch.setattr(
        packing, "native_chunk_max_work", lambda layout, group, lanes, amx: AVX2_CHUNK_MAX_WORK
    )
    packing.BatchPacker.every_long_chunk_native(packer, 4)
    assert packer.native_prefill_max_work == sys.maxsize
    packer.native_prefill_max_work = 512 * 512
    packing.BatchPacker.every_long_chunk_native(packer, 4)
    assert packer.native_prefill_max_work == AVX2_CHUNK_MAX_WORK


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(
    st.lists(st.integers(1, 5000), max_size=40).map(lambda xs: sorted(xs, reverse=True)),
    st.sampled_from([1.0, 1.1, DECODE_PADDING_BOUND, 2.0]),
)
def test_group_decodes_bound_and_cover(kv_lens: list[int], bound: float) -> None:
    groups = group_decodes(kv_lens, bound)
    # The groups cover every index once, in order, without empty groups.
    assert [i for start, end in groups for i in range(start, end)] == list(range(len(kv_lens)))
    assert all(end > start for start, end in groups)
    for start, end in groups:
        lens = kv_lens[start:end]
        assert len(lens) * max(lens) <= bound * sum(lens) + 1e-9, (lens, bound)


@settings(max_examples=100, deadline=None, derandomize=True, database=None)
@given(
    st.lists(st.integers(1, 300), min_size=1, max_size=24),
    st.sampled_from([4, 16, 64]),
    st.integers(0, 2**16),
)
def test_decode_groups_never_mix_requests(kv_lens: list[int], page_size: int, seed: int) -> None:
    """Each decode row attends exactly to its own request's slots (the rest masked), and the padded
    attention work stays within the padding bound of the real KV work."""
    step = build_kernel_step([(n - 1, 1) for n in kv_lens], page_size, 4, 2, 16, seed=seed)
    metadata = step.metadata
    assert not metadata.groups[0].prefill_groups
    covered, work = [], 0
    for group in metadata.groups[0].decode_groups:
        batch, width = group.kv_slots.shape
        assert batch == group.q_end - group.q_start
        lens = [sum(step.seqs[step.packed_order[row]]) for row in range(group.q_start, group.q_end)]
        assert width == max(lens)
        work += batch * width
        for b, row in enumerate(range(group.q_start, group.q_end)):
            i = step.packed_order[row]
            n = lens[b]
            assert torch.equal(group.kv_slots[b, :n].cpu(), step.slots(i, n)), f"row {row} reads foreign KV"
            if group.kv_mask is None:
                assert n == width
            else:
                mask = group.kv_mask[b, 0, 0].cpu()
                assert mask[:n].all() and not mask[n:].any(), f"row {row}: mask {mask.int().tolist()} for {n}"
        covered.extend(range(group.q_start, group.q_end))
    assert covered == list(range(len(kv_lens)))
    assert work <= DECODE_PADDING_BOUND * sum(kv_lens) + 1e-9, (work, sum(kv_lens))
    # Decodes are packed longest first.
    packed_lens = [kv_lens[i] for i in step.packed_order]
    assert packed_lens == sorted(kv_lens, reverse=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_decodes_attend_at_their_exact_length(dtype: torch.dtype) -> None:
    """In bf16 / fp16 a decode group holds only equal KV lengths (no padded, masked keys): a softmax over a
    padded key range rounds differently from `generate()`'s exact-length attention and flips greedy ties
    (seen on the getting-started flow in bf16). float32 still pads within `DECODE_PADDING_BOUND`.
    These are the torch kernels' decode groups (the packer without the native kernel: CUDA, or a machine
    without a compiler); with the native kernel there are no decode groups at all, each row attends at its
    exact length in the kernel, whatever the dtype (`test_kernel_low_precision`)."""
    kv_lens = [40, 38, 38, 35, 12]
    step = build_kernel_step([(n - 1, 1) for n in kv_lens], 16, 4, 2, 16, dtype=dtype, seed=5)
    groups = step.metadata.groups[0].decode_groups
    widths = [group.kv_slots.shape[1] for group in groups]
    if dtype == torch.float32:
        assert len(groups) < len(set(kv_lens)) and any(group.kv_mask is not None for group in groups)
    else:
        assert all(group.kv_mask is None for group in groups)
        assert sorted(widths, reverse=True) == sorted(set(kv_lens), reverse=True)
