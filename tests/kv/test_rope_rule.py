"""A dynamic rotary embedding's rule (kv/rope_rule.py): each token's frequency set from its own request's
lengths, the prefix keys' salt (a prefix computed under one set is never hit by a request needing another),
and the scheduler dropping a Phi-3 request's KV where its `generate()` recomputes it."""

from __future__ import annotations

from types import SimpleNamespace

from tests.kv.test_prefix_cache import PS, request, step
from tests.support.scheduling import scheduler_settings
from transformers_cb.kv.layer_groups import FULL_ATTENTION, KVGroupSpec
from transformers_cb.kv.page_keys import ROOT_KEY, request_keys, root_key
from transformers_cb.kv.page_manager import PageManager
from transformers_cb.kv.page_policies import FullAttentionPolicy
from transformers_cb.kv.pool import PagePool
from transformers_cb.kv.rope_rule import DYNAMIC, LONGROPE, RopeRule, rope_rule_of
from transformers_cb.requests import RequestStatus
from transformers_cb.scheduler.scheduler import Scheduler

LONG = RopeRule(LONGROPE, 32)
PHI3 = RopeRule(LONGROPE, 32, recomputes_at_switch=True)
NTK = RopeRule(DYNAMIC, 32)


def test_longrope_set_from_the_request_own_lengths() -> None:
    # The prompt's tokens see the whole prompt (generate()'s one prefill), a generated one its position.
    assert LONG.frequency_key(30, 30, 0) == 0
    assert LONG.frequency_key(30, 31, 30) == 0
    assert LONG.frequency_key(30, 33, 31) == 0  # position 31 sees 32 tokens: still short
    assert LONG.frequency_key(30, 33, 32) == 1  # position 32 sees 33: long
    assert LONG.frequency_key(40, 40, 0) == 1  # a long prompt's first token already takes the long set
    # Phi-3's generate() recomputes everything at the switch: the request's current length decides.
    assert PHI3.frequency_key(30, 32, 31) == 0
    assert PHI3.frequency_key(30, 33, 0) == 1


def test_dynamic_ntk_set_is_its_effective_length() -> None:
    assert NTK.frequency_key(20, 20, 5) == 0
    assert NTK.frequency_key(40, 40, 5) == 40  # the prompt's set: its whole length
    assert NTK.frequency_key(40, 45, 44) == 45  # a decoded token's: its own position + 1
    assert NTK.frequency_key(20, 34, 33) == 34


def test_prefix_salt_separates_the_sets() -> None:
    assert LONG.prefix_salt(20, 20) == LONG.prefix_salt(32, 50) == b""  # position-only below the switch
    assert LONG.prefix_salt(33, 33) == LONG.prefix_salt(60, 60) != b""
    assert PHI3.prefix_salt(20, 32) == b"" and PHI3.prefix_salt(20, 33) != b""
    assert NTK.prefix_salt(40, 40) != NTK.prefix_salt(41, 41)  # each prompt length its own set
    assert NTK.prefix_salt(32, 40) == b""


def test_salted_keys_differ_from_page_zero_on() -> None:
    tokens = list(range(10, 50))
    short, long = request("short", tokens[:24]), request("long", tokens)
    plain = request_keys(short, 4, PS)
    salted = request_keys(long, 4, PS, LONG.prefix_salt(long.num_prompt_tokens, long.num_tokens))
    assert root_key(b"") == ROOT_KEY and root_key(b"x") != ROOT_KEY
    assert all(a != b for a, b in zip(plain, salted, strict=True))


def rope_scheduler(rule: RopeRule, num_pages: int = 64, max_batch_tokens: int = 64) -> Scheduler:
    pages = PageManager(
        [FullAttentionPolicy(PagePool(num_pages), PS)],
        [KVGroupSpec(FULL_ATTENTION, (0,))],
        sharing=True,
        rope=rule,
    )
    return Scheduler(pages, scheduler_settings(), max_batch_tokens, 64)


def test_a_prefix_across_the_switch_is_not_hit() -> None:
    """A short prompt's pages (short factors) are not hit by a long prompt with the same first tokens,
    and they are by a short one."""
    for rule in (LONG, PHI3, NTK):
        scheduler = rope_scheduler(rule)
        tokens = list(range(10, 50))
        scheduler.add(request("a", tokens[:24], max_new_tokens=2))
        while scheduler.has_work():
            step(scheduler)
        stats = scheduler.pages.prefix.stats
        scheduler.add(request("b", tokens[:40], max_new_tokens=2))
        step(scheduler)
        assert stats.hit_tokens == 0, rule
        scheduler.add(request("c", tokens[:28], max_new_tokens=2))
        step(scheduler)
        assert stats.hit_tokens > 0, rule


def test_phi3_request_recomputes_at_the_switch() -> None:
    """A 30-token prompt decoding past 32 tokens drops its KV once, when it holds 33 tokens with 32
    computed, and recomputes them (with the long set); it is not counted as a preemption."""
    scheduler = rope_scheduler(PHI3, max_batch_tokens=16)
    req = request("r", list(range(10, 40)), max_new_tokens=6)
    scheduler.add(req)
    recomputed_at = []
    while scheduler.has_work():
        plan = step(scheduler)
        if plan.preempted:
            recomputed_at.append(req.num_tokens)
    assert req.status == RequestStatus.FINISHED
    assert recomputed_at == [33]
    assert scheduler.recomputed.total == 32  # its 32 computed tokens ran again
    assert scheduler.num_preemptions == 0
    assert req.num_tokens == 36


def test_rule_read_from_the_config() -> None:
    longrope = SimpleNamespace(
        rope_parameters={"rope_type": "longrope", "original_max_position_embeddings": 4096},
        max_position_embeddings=131072,
    )
    assert rope_rule_of(longrope) == RopeRule(LONGROPE, 4096)
    dynamic = SimpleNamespace(
        rope_parameters={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=2048
    )
    assert rope_rule_of(dynamic) == RopeRule(DYNAMIC, 2048)
    for rope_type in ("default", "linear", "yarn", "llama3"):
        config = SimpleNamespace(rope_parameters={"rope_type": rope_type}, max_position_embeddings=2048)
        assert rope_rule_of(config) is None
    per_layer = SimpleNamespace(
        rope_parameters={"full_attention": {"rope_type": "dynamic"}}, max_position_embeddings=8
    )
    assert rope_rule_of(per_layer) is None


def test_phi3_switch_rule_and_draft_room() -> None:
    assert PHI3.must_recompute(30, 32, 33) and PHI3.must_recompute(30, 31, 35)  # a verify step jumped past
    assert not PHI3.must_recompute(40, 32, 41)  # a long prompt's KV is long already
    assert not PHI3.must_recompute(30, 31, 32) and not PHI3.must_recompute(30, 0, 33)
    assert not LONG.must_recompute(30, 32, 33) and not NTK.must_recompute(30, 32, 33)
    # Drafts verified before the switch only: position q sees q + 1 <= 32 tokens.
    assert PHI3.draft_room(20, 30) == 2 and PHI3.draft_room(20, 32) == 0
    assert PHI3.draft_room(40, 40) is None and LONG.draft_room(20, 30) is None
