"""CPU offload (the host KV tier): exact page ids in both tiers, KV contents across swaps, shared pages,
sliding groups, host exhaustion, cancellation; integrity (device pools, host pools, queues) after every step.

The fake model in `tests.support.offload.Rig` writes a known value for every (request, position) into
real KV tensors and checks, before every step, that the pages each request reads hold its values: a swap that
lost, mixed or misplaced a page fails there. Model-level parity lives in conformance/test_parity_offload.py.
"""

from __future__ import annotations

import torch

from tests.support.offload import Rig
from tests.support.requests import make_request, page_ids, set_page_ids
from transformers_cb.requests import RequestStatus


def _add(rig: Rig, *specs: tuple[str, int, int]):
    requests = [make_request(*spec) for spec in specs]
    for request in requests:
        rig.scheduler.add(request)
    return requests


def test_swap_out_and_in_with_exact_page_ids() -> None:
    rig = Rig(num_pages=6, host_pages=8)
    a, b, c = _add(rig, ("A", 8, 4), ("B", 8, 8), ("C", 7, 8))
    rig.step()  # all three prefill: A [0, 1], B [2, 3], C [4, 5]
    assert (page_ids(a), page_ids(b), page_ids(c)) == ([0, 1], [2, 3], [4, 5])

    batch = rig.scheduler.schedule()  # A and B each need a third page: C (newest) is preempted
    assert [r.request_id for r in batch.preempted] == ["C"]
    plan = batch.swaps
    assert (plan.out_src, plan.out_dst) == ([[4, 5]], [[0, 1]])  # device 4, 5 -> host 0, 1
    assert (page_ids(a), page_ids(b), page_ids(c)) == ([0, 1, 4], [2, 3, 5], [])
    assert c.num_computed_tokens == 7 and c.status == RequestStatus.EVICTED  # kept: nothing to recompute
    assert rig.offload.host.pools[0].num_free_pages == 6 and rig.offload.num_swapped_out == 1
    rig.copier.run(plan)
    for position in range(7):  # C's KV is in host pages 0, 1
        page, offset = divmod(position, 4)
        assert rig.host.tensors[0][0, 0, page, offset, 0, 0].item() == rig.value(c, position)
        assert rig.host.tensors[0][1, 0, page, offset, 0, 1].item() == -rig.value(c, position)
    rig.check_integrity()  # the host pages are C's, the device pages A's and B's


def test_trajectory_with_exact_page_ids_and_kv_checks() -> None:
    """The same workload, run by the rig (KV values checked before every step)."""
    rig = Rig(num_pages=6, host_pages=8)
    a, b, c = _add(rig, ("A", 8, 4), ("B", 8, 8), ("C", 7, 8))
    trace = []
    while rig.scheduler.has_work():
        batch = rig.scheduler.schedule()
        plan = batch.swaps
        trace.append(
            (
                [r.request_id for r in batch.preempted],
                plan.out_src[0],
                plan.out_dst[0],
                plan.in_src[0],
                plan.in_dst[0],
            )
        )
        rig.execute(batch)
    swaps = [t for t in trace if t != ([], [], [], [], [])]
    assert swaps == [
        (["C"], [4, 5], [0, 1], [], []),  # C out: device 4, 5 -> host 0, 1
        ([], [], [], [0, 1], [0, 1]),  # A finished (0, 1, 4 free): C back into device 0, 1
        (["C"], [0, 1], [2, 3], [], []),  # B needs a page: C out again, to host 2, 3
        ([], [], [], [2, 3], [0, 1]),  # B finished: C back
    ]
    assert rig.scheduler.recomputed.total == 0
    assert (rig.offload.swap_out_pages, rig.offload.swap_in_pages) == (4, 4)
    assert rig.copier.num_copies == 4  # one gather/scatter per group and direction per step
    assert [len(r.generated_ids) for r in (a, b, c)] == [4, 8, 8]
    assert rig.pools[0].num_free_pages == 6 and rig.offload.host.pools[0].num_free_pages == 8


def _outputs(num_pages: int, host_pages: int, **kwargs) -> tuple[Rig, dict[str, list[int]]]:
    rig = Rig(num_pages=num_pages, host_pages=host_pages, **kwargs)
    requests = _add(rig, *[(f"r{i}", 5 + 3 * i, 10) for i in range(6)])
    rig.run()
    return rig, {r.request_id: r.generated_ids for r in requests}


def test_offload_and_recompute_give_the_same_tokens() -> None:
    recompute, expected = _outputs(num_pages=10, host_pages=0)
    assert recompute.scheduler.recomputed.total > 0
    offload, outputs = _outputs(num_pages=10, host_pages=64)
    assert outputs == expected
    assert offload.scheduler.num_preemptions > 0 and offload.scheduler.recomputed.total == 0
    assert offload.offload.swap_out_pages == offload.offload.swap_in_pages > 0


def test_host_exhaustion_falls_back_to_recompute() -> None:
    """A host tier of 3 pages: victims that fit swap, the others (and one bigger than the tier) recompute."""
    _, expected = _outputs(num_pages=10, host_pages=0)
    rig, outputs = _outputs(num_pages=10, host_pages=3)
    assert outputs == expected
    assert rig.offload.num_fallbacks > 0 and rig.scheduler.recomputed.total > 0
    assert rig.offload.num_swap_outs > 0
    assert rig.offload.host.pools[0].num_free_pages == 3


def test_request_bigger_than_the_host_tier_is_never_swapped() -> None:
    rig = Rig(num_pages=6, host_pages=1)
    a, b, c = _add(rig, ("A", 8, 4), ("B", 8, 8), ("C", 7, 8))
    rig.step()
    batch = rig.step()
    assert [r.request_id for r in batch.preempted] == ["C"]
    assert rig.offload.num_swapped_out == 0 and rig.offload.num_fallbacks == 1
    assert c.num_computed_tokens == 0 and rig.scheduler.recomputed.pending == {"C": 7}
    assert rig.offload.host.pools[0].num_free_pages == 1
    rig.run()
    assert rig.scheduler.recomputed.total >= 7 and not rig.scheduler.recomputed.pending


def test_sliding_group_swaps_only_the_pages_it_holds() -> None:
    rig = Rig(num_pages=8, host_pages=16, sliding_window=5)
    a, b = _add(rig, ("A", 16, 3), ("B", 15, 3))
    rig.step()  # both prefill; the sliding group keeps only the window's pages
    assert a.pages[1].first_page == 3 and len(a.pages[0].page_ids) == 4 and b.pages[1].first_page == 2
    b_sliding = list(b.pages[1].page_ids)
    first = b.pages[1].first_page
    batch = rig.scheduler.schedule()  # A needs a 5th full page: B is swapped out
    assert [r.request_id for r in batch.preempted] == ["B"]
    assert batch.swaps.out_src[1] == b_sliding  # the sliding group: its window's pages only
    assert rig.offload.swapped["B"][1].first_page == first
    rig.execute(batch)
    rig.run()
    assert rig.scheduler.recomputed.total == 0 and b.generated_ids and len(b.generated_ids) == 3


def test_shared_pages_stay_resident_and_come_back() -> None:
    """A page another request still references (refcount 2) is not copied; the swapped-out request keeps
    its reference and gets the same page back. Its own page moves through the host tier."""
    rig = Rig(num_pages=8, host_pages=8)
    policy = rig.policies[0]
    a, b = make_request("A", 8, 4), make_request("B", 8, 4)
    assert policy.allocate(a, 8)  # A: pages 0, 1
    policy.pool.share([0])  # B shares A's first page (prefix sharing)
    set_page_ids(b, [0])
    assert policy.allocate(b, 8)  # B: pages 0 (shared), 2
    a.num_computed_tokens = b.num_computed_tokens = 8
    marker = torch.full_like(rig.cache.group_tensors[0][:, :, 2], 7.0)
    rig.cache.group_tensors[0][:, :, 2] = marker
    assert rig.offload.try_swap_out(b)
    assert (rig.offload.plan.out_src, rig.offload.plan.out_dst) == ([[2]], [[0]])
    policy.free(b)  # the scheduler's release after a swap-out
    assert policy.pool.refcount(0) == 2 and policy.pool.refcount(2) == 0  # A + B's kept reference
    assert rig.offload.device_tables() == [[[0]]]
    policy.pool.check_integrity([page_ids(a), *rig.offload.device_tables()[0]])
    rig.run_swaps()
    assert torch.equal(rig.host.tensors[0][:, :, 0], marker)
    rig.cache.group_tensors[0][:, :, 2] = 0.0  # page 2 reused and overwritten
    x = make_request("X", 4, 1)
    assert policy.allocate(x, 4) and page_ids(x) == [3]  # the free list is 3..7, then 2
    assert rig.offload.pages_to_swap_in(b) == [2]  # its host page, and a page for its next token
    rig.offload.swap_in(b)
    assert page_ids(b) == [0, 4] and policy.pool.refcount(0) == 2  # same shared page, fresh page 4
    assert (rig.offload.plan.in_src, rig.offload.plan.in_dst) == ([[0]], [[4]])
    rig.run_swaps()
    assert torch.equal(rig.cache.group_tensors[0][:, :, 4], marker)
    assert rig.offload.host.pools[0].num_free_pages == 8


def test_cancel_while_swapped_out_frees_host_pages() -> None:
    rig = Rig(num_pages=6, host_pages=8)
    a, b, c = _add(rig, ("A", 8, 4), ("B", 8, 8), ("C", 7, 8))
    rig.step()
    rig.step()
    assert rig.offload.is_swapped(c) and rig.offload.host.pools[0].num_used_pages == 2
    rig.scheduler.finish(c, RequestStatus.CANCELLED, "cancelled")
    assert not rig.offload.is_swapped(c) and rig.offload.host.pools[0].num_used_pages == 0
    rig.check_integrity()
    rig.run()
    assert c.status == RequestStatus.CANCELLED and rig.pools[0].num_free_pages == 6


def test_discard_drops_copies_not_run_yet() -> None:
    """Discarded between its swap-out decision and the plan's hand-over: the copy is dropped, so that its
    host pages may be reused at once. Cancelled after `schedule()` (the copy is in the step's plan): its
    host pages are free at once and the step's stale copy into them is harmless."""
    rig = Rig(num_pages=6, host_pages=8)
    a, b, c = _add(rig, ("A", 8, 4), ("B", 8, 8), ("C", 7, 8))
    rig.step()
    assert rig.offload.try_swap_out(c)
    assert rig.offload.plan.out_dst == [[0, 1]]
    rig.offload.discard(c)
    assert rig.offload.plan.out_src == [[]] and rig.offload.plan.out_dst == [[]]
    batch = rig.scheduler.schedule()
    assert batch.swaps.out_src == [[4, 5]]  # C out again, in the step's plan
    rig.scheduler.finish(c, RequestStatus.CANCELLED, "cancelled")
    assert rig.offload.host.num_used_pages == 0
    rig.execute(batch)
    rig.run()
    assert rig.offload.host.num_used_pages == 0 and rig.pools[0].num_free_pages == 6


def test_swapped_request_recomputes_when_nothing_runs_and_it_cannot_come_back() -> None:
    """Nothing running and no room for its pages (another swapped-out request keeps a shared page): it
    falls back to recompute instead of waiting forever."""
    rig = Rig(num_pages=6, host_pages=8)
    a, b, c = _add(rig, ("A", 8, 4), ("B", 8, 8), ("C", 7, 8))
    rig.step()
    rig.step()
    assert rig.offload.is_swapped(c)
    for request in (a, b):
        rig.scheduler.finish(request, RequestStatus.CANCELLED, "cancelled")
    # Fill the device with pages held by nobody the scheduler knows (as the prefix cache could).
    held = rig.pools[0].allocate(5)
    rig.scheduler.schedule()
    assert not rig.offload.is_swapped(c) and rig.scheduler.recomputed.pending == {"C": 7}
    rig.pools[0].release(held)
