"""memory/zeroed.py: zero-filled tensors paid per page touched."""

from __future__ import annotations

import gc

import psutil
import pytest
import torch

from transformers_cb.memory.kv_cache import PagedKVCache
from transformers_cb.memory.zeroed import MAPPED_MIN_BYTES, zeroed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("nbytes", [256, MAPPED_MIN_BYTES, 3 * MAPPED_MIN_BYTES + 4096])
def test_zeroed_is_a_plain_tensor_of_zeros(dtype: torch.dtype, nbytes: int) -> None:
    shape = (4, nbytes // dtype.itemsize // 4)
    tensor = zeroed(shape, dtype, "cpu")
    assert tensor.shape == shape and tensor.dtype == dtype and tensor.is_contiguous()
    assert not tensor.any()
    tensor[1, 3:7] = 5  # writable, in place, and no other element moves
    assert int(tensor.sum()) == 20
    view = tensor.view(-1)
    assert view.data_ptr() == tensor.data_ptr()


def test_a_mapped_tensor_outlives_every_other_reference() -> None:
    tensor = zeroed((MAPPED_MIN_BYTES // 4,), torch.float32, "cpu")[16:]
    gc.collect()
    tensor.fill_(2.0)
    assert float(tensor.sum()) == 2.0 * tensor.numel()


def test_untouched_pages_take_no_memory() -> None:
    process = psutil.Process()
    before = process.memory_info().rss
    tensor = zeroed((256 << 20,), torch.uint8, "cpu")
    tensor[: 8 << 20] = 1
    grown = process.memory_info().rss - before
    # 256 MiB of zeros, 8 MiB written: the rest was never paid for (torch.zeros would add all 256)
    assert grown < 96 << 20, grown
    assert int(tensor[8 << 20 :].sum()) == 0


def test_a_large_cache_reads_zero_everywhere_and_again_after_a_restore() -> None:
    cache = PagedKVCache(
        num_layers=2,
        num_pages=64,
        page_size=64,
        num_kv_heads=4,
        head_dim=64,
        dtype=torch.float32,
        device="cpu",
    )
    assert cache.nbytes() >= MAPPED_MIN_BYTES
    assert all(not t.any() for t in cache.group_tensors)
    cache.keys[1][5].fill_(3.0)
    assert float(cache.group_tensors[0].sum()) == 3.0 * 4 * 64
    cache.release()
    cache.restore()
    assert all(not t.any() for t in cache.group_tensors)
    assert cache.keys[0].shape == (64 * 64, 4, 64)
