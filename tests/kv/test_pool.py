"""PagePool, FullAttentionPolicy and BlockTables: exact page ids, refcounts, integrity checks."""

from __future__ import annotations

from collections import deque

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tests.support.requests import make_request, page_ids, set_page_ids
from transformers_cb.kv.page_policies import FullAttentionPolicy, num_pages_for
from transformers_cb.kv.pool import PagePool
from transformers_cb.memory.block_tables import BlockTables


def free_list(pool: PagePool) -> list[int]:
    return list(pool._free)


# -- PagePool ------------------------------------------------------------------------------------


def test_fresh_pool_is_all_free_in_order() -> None:
    pool = PagePool(5)
    assert pool.num_pages == 5
    assert pool.num_free_pages == 5
    assert pool.num_used_pages == 0
    assert free_list(pool) == [0, 1, 2, 3, 4]
    assert [pool.refcount(p) for p in range(5)] == [0] * 5
    pool.check_integrity([])


def test_pool_needs_at_least_one_page() -> None:
    with pytest.raises(AssertionError):
        PagePool(0)


def test_allocate_hands_out_pages_in_order() -> None:
    pool = PagePool(6)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) == [2, 3, 4]
    assert pool.allocate(0) == []
    assert pool.num_free_pages == 1
    assert pool.num_used_pages == 5
    assert [pool.refcount(p) for p in range(6)] == [1, 1, 1, 1, 1, 0]
    pool.check_integrity([[0, 1], [2, 3, 4]])


def test_freed_pages_go_to_the_back_of_the_free_list() -> None:
    pool = PagePool(6)
    first = pool.allocate(3)
    assert first == [0, 1, 2]
    pool.release([1])
    assert free_list(pool) == [3, 4, 5, 1]
    pool.release([0, 2])
    assert free_list(pool) == [3, 4, 5, 1, 0, 2]
    # The oldest free pages are handed out first, freed ones last.
    assert pool.allocate(4) == [3, 4, 5, 1]
    assert pool.allocate(2) == [0, 2]
    assert pool.num_free_pages == 0
    pool.check_integrity([[3, 4, 5, 1], [0, 2]])


def test_allocate_too_many_returns_none_and_changes_nothing() -> None:
    pool = PagePool(4)
    assert pool.allocate(3) == [0, 1, 2]
    before_free, before_refs = free_list(pool), [pool.refcount(p) for p in range(4)]
    assert pool.allocate(2) is None
    assert pool.allocate(100) is None
    assert free_list(pool) == before_free == [3]
    assert [pool.refcount(p) for p in range(4)] == before_refs
    assert pool.allocate(1) == [3]
    assert pool.allocate(1) is None


def test_allocate_negative_asserts() -> None:
    with pytest.raises(AssertionError):
        PagePool(3).allocate(-1)


def test_share_and_release_refcounts() -> None:
    pool = PagePool(4)
    pages = pool.allocate(2)
    assert pages == [0, 1]
    pool.share([0, 1])
    pool.share([0])
    assert pool.refcount(0) == 3
    assert pool.refcount(1) == 2
    pool.check_integrity([[0, 1], [0, 1], [0]])
    pool.release([0, 1])
    assert (pool.refcount(0), pool.refcount(1)) == (2, 1)
    assert free_list(pool) == [2, 3], "shared pages stay in use until the last reference goes"
    pool.release([1])
    assert free_list(pool) == [2, 3, 1]
    pool.release([0])
    pool.release([0])
    assert free_list(pool) == [2, 3, 1, 0]
    assert pool.num_used_pages == 0
    pool.check_integrity([])


def test_share_free_page_asserts() -> None:
    pool = PagePool(3)
    with pytest.raises(AssertionError, match="sharing free page 0"):
        pool.share([0])


def test_double_free_asserts() -> None:
    pool = PagePool(3)
    pages = pool.allocate(1)
    pool.release(pages)
    with pytest.raises(AssertionError, match="double free of page 0"):
        pool.release(pages)
    with pytest.raises(AssertionError, match="double free of page 2"):
        pool.release([2])
    # The failed releases changed nothing.
    assert free_list(pool) == [1, 2, 0]
    pool.check_integrity([])


# -- check_integrity on corrupted states ---------------------------------------------------------


def test_integrity_detects_refcount_mismatch_with_tables() -> None:
    pool = PagePool(4)
    pool.allocate(2)
    pool.check_integrity([[0, 1]])
    pool._refcounts[1] = 2  # one reference too many
    with pytest.raises(AssertionError, match="page 1: refcount 2 but held by 1 tables"):
        pool.check_integrity([[0, 1]])


def test_integrity_detects_page_in_two_tables_without_refcount() -> None:
    pool = PagePool(4)
    pool.allocate(2)
    with pytest.raises(AssertionError, match="page 0: refcount 1 but held by 2 tables"):
        pool.check_integrity([[0, 1], [0]])


def test_integrity_detects_page_held_by_no_table() -> None:
    pool = PagePool(4)
    pool.allocate(2)
    with pytest.raises(AssertionError, match="page 1: refcount 1 but held by 0 tables"):
        pool.check_integrity([[0]])


def test_integrity_detects_free_page_with_refcount() -> None:
    pool = PagePool(4)
    pool._refcounts[3] = 1  # page 3 is still in the free list
    with pytest.raises(AssertionError, match="page 3: refcount 1, free=True"):
        pool.check_integrity()


def test_integrity_detects_used_page_with_zero_refcount() -> None:
    pool = PagePool(4)
    pool.allocate(1)
    pool._refcounts[0] = 0  # neither free nor referenced: a leak
    with pytest.raises(AssertionError, match="page 0: refcount 0, free=False"):
        pool.check_integrity()


def test_integrity_detects_page_twice_in_free_list() -> None:
    pool = PagePool(4)
    pool._free.append(2)
    with pytest.raises(AssertionError, match="twice in the free list"):
        pool.check_integrity()


def test_integrity_detects_unknown_page_in_free_list() -> None:
    pool = PagePool(4)
    pool.allocate(1)
    pool._free[0] = 17
    with pytest.raises(AssertionError, match="unknown page id"):
        pool.check_integrity()


def test_integrity_detects_negative_refcount() -> None:
    pool = PagePool(4)
    pool.allocate(4)
    pool._refcounts[2] = -1
    with pytest.raises(AssertionError, match="page 2 has refcount -1"):
        pool.check_integrity()


def test_integrity_detects_table_repeating_a_page() -> None:
    pool = PagePool(4)
    pool.allocate(1)
    pool.share([0])
    with pytest.raises(AssertionError, match="repeats a page"):
        pool.check_integrity([[0, 0]])


# -- FullAttentionPolicy ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_tokens", "page_size", "expected"),
    [
        (0, 4, 0),
        (1, 4, 1),
        (3, 4, 1),
        (4, 4, 1),
        (5, 4, 2),
        (8, 4, 2),
        (9, 4, 3),
        (256, 256, 1),
        (257, 256, 2),
    ],
)
def test_num_pages_for(num_tokens: int, page_size: int, expected: int) -> None:
    assert num_pages_for(num_tokens, page_size) == expected


def test_num_new_pages_at_page_boundaries() -> None:
    policy = FullAttentionPolicy(PagePool(8), page_size=4)
    request = make_request()
    assert [policy.num_new_pages(request, n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    # 3 tokens computed in one page: 1 more fits, the 2nd opens a new page.
    set_page_ids(request, [0])
    request.num_computed_tokens = 3
    assert [policy.num_new_pages(request, n) for n in (0, 1, 2, 5, 6)] == [0, 0, 1, 1, 2]
    # Exactly one full page computed: the next token needs a new page.
    request.num_computed_tokens = 4
    assert policy.num_new_pages(request, 1) == 1
    assert policy.num_new_pages(request, 4) == 1
    assert policy.num_new_pages(request, 5) == 2
    # Pages held ahead of need (allocated for a chunk not yet computed) are counted.
    set_page_ids(request, [0, 1])
    request.num_computed_tokens = 4
    assert policy.num_new_pages(request, 4) == 0
    assert policy.num_new_pages(request, 5) == 1
    assert policy.pool.num_free_pages == 8, "num_new_pages is pure"


def test_num_fitting_tokens_at_page_boundaries() -> None:
    pool = PagePool(3)
    policy = FullAttentionPolicy(pool, page_size=4)
    request = make_request()
    assert policy.num_fitting_tokens(request, 5) == 5
    assert policy.num_fitting_tokens(request, 12) == 12
    assert policy.num_fitting_tokens(request, 13) == 12
    assert policy.num_fitting_tokens(request, 0) == 0
    other = make_request("other")
    assert policy.allocate(other, 8)
    assert page_ids(other) == [0, 1]
    # `request` holds one page with 3 tokens computed; one page is free: (1 + 1) * 4 - 3 = 5 fit.
    set_page_ids(request, pool.allocate(1))
    assert page_ids(request) == [2]
    request.num_computed_tokens = 3
    assert policy.num_fitting_tokens(request, 100) == 1  # pool is now full: only its own page's tail
    policy.free(other)
    assert policy.num_fitting_tokens(request, 100) == 9
    assert policy.num_fitting_tokens(request, 2) == 2
    request.num_computed_tokens = 4
    pool.allocate(2)  # fill the pool again
    assert policy.num_fitting_tokens(request, 1) == 0
    assert pool.num_free_pages == 0


def test_page_policy_allocate_and_free_exact_pages() -> None:
    pool = PagePool(5)
    policy = FullAttentionPolicy(pool, page_size=4)
    a, b = make_request("a"), make_request("b")
    assert policy.allocate(a, 5)
    assert page_ids(a) == [0, 1]
    assert policy.allocate(b, 4)
    assert page_ids(b) == [2]
    a.num_computed_tokens = 5
    assert policy.allocate(a, 3)  # 8 tokens: still 2 pages
    assert page_ids(a) == [0, 1]
    a.num_computed_tokens = 8
    assert policy.allocate(a, 1)
    assert page_ids(a) == [0, 1, 3]
    pool.check_integrity([page_ids(a), page_ids(b)])
    # Too large: nothing changes.
    b.num_computed_tokens = 4
    assert not policy.allocate(b, 9)
    assert page_ids(b) == [2]
    assert free_list(pool) == [4]
    policy.free(a)
    assert page_ids(a) == []
    assert free_list(pool) == [4, 0, 1, 3]
    assert policy.allocate(b, 9)
    assert page_ids(b) == [2, 4, 0, 1]
    pool.check_integrity([page_ids(a), page_ids(b)])
    policy.free(b)
    assert pool.num_free_pages == 5
    pool.check_integrity([])


def test_page_policy_max_pages() -> None:
    policy = FullAttentionPolicy(PagePool(2), page_size=16)
    assert [policy.max_pages(n) for n in (1, 16, 17, 32, 33)] == [1, 1, 2, 2, 3]


# -- BlockTables ---------------------------------------------------------------------------------


def test_block_tables_rows_and_incremental_writes() -> None:
    tables = BlockTables(max_pages_per_request=4, device=torch.device("cpu"), initial_rows=2)
    a, b = make_request("a"), make_request("b")
    set_page_ids(a, [5, 3])
    assert tables.sync(a) == 0
    assert tables.table[0, :2].tolist() == [5, 3]
    set_page_ids(b, [1])
    assert tables.sync(b) == 1
    assert tables.table[1, :1].tolist() == [1]
    # Only new pages are written: earlier entries of the row are left as they are.
    tables.table[0, 0] = 99
    page_ids(a).append(7)
    assert tables.sync(a) == 0
    assert tables.table[0, :3].tolist() == [99, 3, 7]
    assert tables.sync(a) == 0  # idempotent
    # A released row is reused by the next request.
    tables.release(a)
    c = make_request("c")
    set_page_ids(c, [2, 4])
    assert tables.sync(c) == 0
    assert tables.table[0, :2].tolist() == [2, 4]
    tables.release(make_request("unknown"))  # no-op


def test_block_tables_grow_and_keep_rows() -> None:
    tables = BlockTables(max_pages_per_request=3, device=torch.device("cpu"), initial_rows=2)
    requests = [make_request(f"r{i}") for i in range(5)]
    for i, request in enumerate(requests):
        set_page_ids(request, [i, i + 10])
        assert tables.sync(request) == i
    assert tables.table.shape == (8, 3)
    for i in range(5):
        assert tables.table[i, :2].tolist() == [i, i + 10]


def test_block_tables_refuse_shrinking_or_overflowing_rows() -> None:
    tables = BlockTables(max_pages_per_request=2, device=torch.device("cpu"), initial_rows=1)
    request = make_request()
    set_page_ids(request, [0, 1])
    tables.sync(request)
    set_page_ids(request, [0])
    with pytest.raises(AssertionError, match="shrank"):
        tables.sync(request)
    set_page_ids(request, [0, 1, 2])
    with pytest.raises(AssertionError, match="num_pages=3"):
        tables.sync(request)


def test_block_tables_take_back_pages_from_the_end() -> None:
    """Speculation gives back the pages of rejected draft tokens: told so, the row rewrites the freed
    column when a page is appended again."""
    tables = BlockTables(max_pages_per_request=4, device=torch.device("cpu"), initial_rows=1)
    request = make_request()
    set_page_ids(request, [0, 1, 2])
    row = tables.sync(request)
    set_page_ids(request, [0, 1])
    tables.take_back(request, 2)
    tables.check_integrity([request])
    set_page_ids(request, [0, 1, 7])
    tables.sync(request)
    assert tables.table[row, :3].tolist() == [0, 1, 7]
    tables.check_integrity([request])


# -- Property tests ------------------------------------------------------------------------------


class PoolMachine(RuleBasedStateMachine):
    """Random allocate / share / release sequences against a simple model of the free list."""

    def __init__(self) -> None:
        super().__init__()
        self.pool: PagePool | None = None
        self.expected_free: deque[int] = deque()
        self.refs: dict[int, int] = {}
        self.tables: list[list[int]] = []

    @initialize(num_pages=st.integers(1, 12))
    def create(self, num_pages: int) -> None:
        self.pool = PagePool(num_pages)
        self.expected_free = deque(range(num_pages))
        self.refs = dict.fromkeys(range(num_pages), 0)

    @precondition(lambda self: self.pool is not None)
    @rule(num=st.integers(0, 14))
    def allocate(self, num: int) -> None:
        pages = self.pool.allocate(num)
        if num > len(self.expected_free):
            assert pages is None
            return
        expected = [self.expected_free.popleft() for _ in range(num)]
        assert pages == expected
        for page in pages:
            self.refs[page] = 1
        self.tables.append(pages)

    @precondition(lambda self: self.pool is not None and self.tables)
    @rule(data=st.data())
    def share_prefix(self, data: st.DataObject) -> None:
        table = data.draw(st.sampled_from(self.tables))
        prefix = table[: data.draw(st.integers(0, len(table)))]
        self.pool.share(prefix)
        for page in prefix:
            self.refs[page] += 1
        self.tables.append(list(prefix))

    @precondition(lambda self: self.pool is not None and self.tables)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        index = data.draw(st.integers(0, len(self.tables) - 1))
        table = self.tables.pop(index)
        self.pool.release(table)
        for page in table:
            self.refs[page] -= 1
            if self.refs[page] == 0:
                self.expected_free.append(page)

    @precondition(lambda self: self.pool is not None)
    @rule(page=st.integers(0, 11))
    def double_free_is_refused(self, page: int) -> None:
        if page >= self.pool.num_pages or self.refs[page] != 0:
            return
        with pytest.raises(AssertionError):
            self.pool.release([page])

    @invariant()
    def consistent(self) -> None:
        if self.pool is None:
            return
        self.pool.check_integrity(self.tables)
        assert list(self.pool._free) == list(self.expected_free)
        assert [self.pool.refcount(p) for p in range(self.pool.num_pages)] == [
            self.refs[p] for p in range(self.pool.num_pages)
        ]
        assert self.pool.num_free_pages + self.pool.num_used_pages == self.pool.num_pages


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


@settings(max_examples=60, deadline=None)
@given(
    num_pages=st.integers(1, 10),
    page_size=st.integers(1, 6),
    ops=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 25)), max_size=40),
)
def test_page_policy_ops_keep_integrity(num_pages: int, page_size: int, ops: list[tuple[int, int]]) -> None:
    """Grow / compute / free random requests through the policy; integrity holds after every op."""
    pool = PagePool(num_pages)
    policy = FullAttentionPolicy(pool, page_size)
    requests = [make_request(f"r{i}") for i in range(4)]
    for index, num_tokens in ops:
        request = requests[index]
        if num_tokens == 0:
            policy.free(request)
            request.num_computed_tokens = 0
        else:
            fitting = policy.num_fitting_tokens(request, num_tokens)
            needed = policy.num_new_pages(request, num_tokens)
            free_before = pool.num_free_pages
            ok = policy.allocate(request, num_tokens)
            assert ok == (needed <= free_before)
            assert ok == (fitting == num_tokens)
            if ok:
                request.num_computed_tokens += num_tokens
                assert len(page_ids(request)) == num_pages_for(request.num_computed_tokens, page_size)
                assert pool.num_free_pages == free_before - needed
            else:
                assert pool.num_free_pages == free_before
        pool.check_integrity([page_ids(r) for r in requests])
    for request in requests:
        policy.free(request)
    assert pool.num_free_pages == num_pages
    pool.check_integrity([])
