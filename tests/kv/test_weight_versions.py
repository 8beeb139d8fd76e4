"""A weight update in kv/: `PagePool.forget_keys` (every key dropped, cached pages freed, pages in use
unkeyed) and `PrefixCache.weights_changed` (a request whose KV predates the weights keys and promises
nothing)."""

from __future__ import annotations

from transformers_cb.kv.layer_groups import FULL_ATTENTION, KVGroupSpec
from transformers_cb.kv.page_keys import ROOT_KEY, page_key
from transformers_cb.kv.page_manager import PageManager
from transformers_cb.kv.page_policies import FullAttentionPolicy
from transformers_cb.kv.pool import PagePool
from transformers_cb.requests import Request


def test_forget_keys_frees_cached_pages_and_unkeys_pages_in_use() -> None:
    pool = PagePool(4)
    held, cached = pool.allocate(2) or []
    for page_id, tokens in ((held, (1, 2)), (cached, (3, 4))):
        pool.register(page_id, page_key(ROOT_KEY, tokens), ROOT_KEY, tokens)
    pool.release([cached])
    assert (pool.num_cached_pages, pool.num_keyed_pages) == (1, 2)
    assert pool.forget_keys() == 2
    pool.check_integrity([[held]])
    assert (pool.num_cached_pages, pool.num_keyed_pages, pool.num_free_pages) == (0, 0, 3)
    assert pool.lookup(page_key(ROOT_KEY, (1, 2)), ROOT_KEY, (1, 2)) is None
    pool.release([held])  # unkeyed now: freed, not cached
    assert (pool.num_cached_pages, pool.num_free_pages) == (0, 4)
    pool.check_integrity([])


def test_a_request_older_than_the_weights_keys_and_promises_nothing() -> None:
    pages = PageManager(
        [FullAttentionPolicy(PagePool(8), 2)], [KVGroupSpec(FULL_ATTENTION, (0,))], sharing=True
    )
    prefix = pages.prefix
    assert prefix is not None
    old = Request(request_id="old", prompt_ids=[5, 6, 7, 8, 9], max_new_tokens=2)
    old.kv_version = 0
    assert pages.allocate(old, 5)
    pages.promise(old)
    assert old.num_promised_pages == 2
    pages.weights_changed(1, [old])
    assert old.num_promised_pages == 0 and not prefix.current(old)
    pages.check_integrity([old], [old])
    pages.promise(old)  # admitted again (a swap-in) with its old KV: no promise
    old.num_computed_tokens = 5
    pages.register(old)
    assert old.num_promised_pages == 0 and pages.pools[0].num_keyed_pages == 0
    new = Request(request_id="new", prompt_ids=[5, 6, 7, 8, 9], max_new_tokens=2)
    new.kv_version = 1
    assert pages.attach_prefix(new) == 0
    assert pages.allocate(new, 5)
    pages.promise(new)
    new.num_computed_tokens = 5
    pages.register(new)
    assert pages.pools[0].num_keyed_pages == 2
    pages.check_integrity([old, new], [old, new])
