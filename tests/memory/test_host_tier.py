"""The host tier's bytes (memory/host_cache.py) and the swap copier (memory/swap.py): sizing from
`cpu_offload_space` and the work, pinned tensors and a side stream on CUDA, one gather and one scatter per KV
group and direction per step, contents intact across a swap out and back."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from tests.support.offload import Rig
from tests.support.requests import make_request, page_ids
from transformers_cb import ContinuousBatchingConfig
from transformers_cb.memory.host_cache import GIB, HostKVCache, host_page_bytes, resolve_host_pages


def test_host_pool_sizing() -> None:
    rig = Rig(num_pages=4, host_pages=1, sliding_window=5)
    page_bytes = host_page_bytes(rig.cache)
    assert page_bytes == 2 * 2 * (4 * 1 * 2 * 4)  # 2 groups x (K, V) x page_size x heads x head_dim x fp32
    assert resolve_host_pages(ContinuousBatchingConfig(), rig.cache.layout) == 0  # 0.0: off
    config = ContinuousBatchingConfig(cpu_offload_space=10 * page_bytes / GIB)
    assert resolve_host_pages(config, rig.cache.layout) == 10
    assert resolve_host_pages(config.copy(cpu_offload_space=30 * page_bytes / GIB), rig.cache.layout) == 16
    assert resolve_host_pages(config, rig.cache.layout, workload=[9, 4]) == 4  # what the work can use: 3 + 1
    assert (
        resolve_host_pages(ContinuousBatchingConfig(cpu_offload_space=page_bytes / 2 / GIB), rig.cache.layout)
        == 0
    )
    # A CPU device with the workload unknown: at most 4x the device cache (both tiers share the RAM).
    assert resolve_host_pages(ContinuousBatchingConfig(cpu_offload_space=None), rig.cache.layout) == 16
    host = HostKVCache(rig.cache, 3)
    assert [tuple(t.shape) for t in host.tensors] == [(2, 1, 3, 4, 1, 2)] * 2
    assert host.nbytes() == 3 * page_bytes and not host.pinned


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_host_tier_is_pinned_and_copies_run_on_a_side_stream() -> None:
    from transformers_cb.kv.offload import CpuOffload
    from transformers_cb.kv.page_policies import make_page_policy
    from transformers_cb.kv.pool import PagePool
    from transformers_cb.memory.kv_cache import PagedKVCache
    from transformers_cb.memory.swap import SwapCopier

    device = torch.device("cuda")
    cache = PagedKVCache(2, 8, 4, 1, 2, torch.float32, device)
    host = HostKVCache(cache, 4)
    assert host.pinned and all(t.is_pinned() for t in host.tensors)
    copier = SwapCopier(cache.group_tensors, host.tensors)
    assert copier.stream is not None and copier.stream != torch.cuda.current_stream(device)
    policy = make_page_policy(cache.groups[0], PagePool(8), 4, 0)
    offload = CpuOffload([policy], 4)
    request = make_request("A", 8, 2)
    assert policy.allocate(request, 8)
    request.num_computed_tokens = 8
    cache.group_tensors[0][:, :, page_ids(request)] = 5.0
    assert offload.try_swap_out(request)
    policy.free(request)
    copier.run(offload.take_plan())
    cache.group_tensors[0].zero_()  # the forward may overwrite the freed pages right after
    copier.synchronize()
    assert bool((host.tensors[0][:, :, :2] == 5.0).all())
    offload.swap_in(request)
    copier.run(offload.take_plan())
    torch.cuda.current_stream(device).synchronize()
    assert bool((cache.group_tensors[0][:, :, page_ids(request)] == 5.0).all())


def test_generate_batch_sizes_the_host_tier_to_the_work() -> None:
    """`cpu_offload_space=8.0` on a small job takes what the job can use, not 8 GiB."""
    from unittest import mock

    from tests.support.models import tiny_llama
    from tests.support.prompts import prompts_of_lengths
    from transformers_cb.engine.engine import Engine

    model = tiny_llama()
    engines = []
    original = Engine.step

    def step(self):
        engines.append(self)
        return original(self)

    prompts = prompts_of_lengths([10, 30], seed=2)
    with mock.patch.object(Engine, "step", step):
        model.generate_batch(
            prompts,
            max_new_tokens=6,
            continuous_batching_config=ContinuousBatchingConfig(page_size=4, cpu_offload_space=8.0),
            progress_bar=False,
        )
    offload = engines[-1].offload
    assert offload is not None and offload.host.num_pages == 4 + 9  # ceil(15 / 4) + ceil(35 / 4)


def test_one_gather_and_scatter_per_group_and_direction_per_step() -> None:
    """Two requests swapped out in one step, in a model with two KV groups: two copies (one per group), each
    moving both requests' pages of every layer; then both back in one step: two more."""
    rig = Rig(num_pages=12, host_pages=12, sliding_window=16)
    requests = [make_request(name, 8, 2) for name in "ABC"]
    for request in requests:
        assert rig.scheduler.pages.allocate(request, 8)
        request.num_computed_tokens = 8
    for g, tensor in enumerate(rig.cache.group_tensors):
        for page in range(12):
            tensor[:, :, page] = 100 * g + page  # each page holds its own id
    a, b, c = requests
    before = [[list(r.pages[g].page_ids) for g in range(2)] for r in (b, c)]
    calls = []
    original = torch.Tensor.index_select
    with mock.patch.object(
        torch.Tensor, "index_select", lambda t, d, i: calls.append(1) or original(t, d, i)
    ):
        for request in (b, c):
            assert rig.offload.try_swap_out(request)
            rig.scheduler.pages.free(request)
        rig.run_swaps()
        assert len(calls) == 2 and rig.copier.num_copies == 2
        for pages in before:  # the freed device pages are reused and overwritten
            for g in range(2):
                rig.cache.group_tensors[g][:, :, pages[g]] = -1.0
        for request in (b, c):
            rig.offload.swap_in(request)
        rig.run_swaps()
        assert len(calls) == 4 and rig.copier.num_copies == 4
    for request, old in zip((b, c), before, strict=True):
        for g in range(2):
            new = request.pages[g].page_ids
            expected = torch.tensor([100.0 * g + p for p in old[g]]).view(1, 1, -1, 1, 1, 1)
            assert bool((rig.cache.group_tensors[g][:, :, new] == expected).all()), (request.request_id, g)
