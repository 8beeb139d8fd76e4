"""Prefix sharing and forks against plain `generate()`: sharing on and off give the same tokens.

Prompt sets share 0 %, 50 % or 100 % of their pages, under chunked prefill and under eviction, with
pages of 4 and 16 tokens; a hybrid (full + sliding) model too. A hypothesis test draws prompt sets
from a few shared prefixes and checks parity, one final result per request and the engine's
integrity after every step. Forks (`num_return_sequences`): greedy siblings equal the parent, seeded
sampling is reproducible.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import GenerationConfig

from conformance.common import (
    ReferenceCache,
    check_parity,
    count_preemptions,
    greedy_config,
    tight_num_blocks,
)
from tests.support.models import build_tiny_model, sharpen_attention, tiny_llama
from tests.support.requests import page_ids
from transformers_cb import ContinuousBatchingConfig, RequestStatus
from transformers_cb.attention.selection import paged_backend
from transformers_cb.engine.build import build_engine
from transformers_cb.engine.intake.submission import Submission

MAX_NEW_TOKENS = 8
VOCAB = 300


@pytest.fixture(scope="module")
def llama():
    return build_tiny_model("llama")


@pytest.fixture(scope="module")
def references(llama) -> ReferenceCache:
    return ReferenceCache(llama, MAX_NEW_TOKENS)


def shared_prompts(share: float, page_size: int, seed: int = 0) -> list[list[int]]:
    """Six prompts of 3 pages + a few tokens whose first `share` of the pages are the same."""
    rng = random.Random(seed)
    num_shared = round(3 * page_size * share)
    common = [rng.randrange(3, VOCAB) for _ in range(num_shared)]
    prompts = []
    for _ in range(6):
        rest = 3 * page_size - num_shared + rng.randint(1, page_size - 1)
        prompts.append(common + [rng.randrange(3, VOCAB) for _ in range(rest)])
    return prompts


def run(model, prompts, sharing: bool, **cb_kwargs):
    config = ContinuousBatchingConfig(allow_block_sharing=sharing, **cb_kwargs)
    with count_preemptions() as preemptions:
        outputs = model.generate_batch(
            prompts,
            greedy_config(MAX_NEW_TOKENS),
            continuous_batching_config=config,
            progress_bar=False,
        )
    return outputs, preemptions


@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("share", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("pressure", ["roomy", "chunked", "evicting"])
def test_sharing_on_and_off_match_generate(llama, references, page_size, share, pressure) -> None:
    prompts = shared_prompts(share, page_size)
    cb_kwargs = {"page_size": page_size}
    if pressure == "chunked":
        cb_kwargs["max_batch_tokens"] = 16
    elif pressure == "evicting":
        cb_kwargs["num_blocks"] = tight_num_blocks(prompts, MAX_NEW_TOKENS, page_size) + 2
        cb_kwargs["max_batch_tokens"] = 32
    expected = [references.get(p) for p in prompts]
    context = f"{page_size=} {share=} {pressure}"
    outputs = {}
    for sharing in (False, True):
        outputs[sharing], preemptions = run(llama, prompts, sharing, **cb_kwargs)
        check_parity(llama, prompts, outputs[sharing], expected, f"{context} sharing={sharing}")
        if pressure == "evicting" and not sharing:
            assert preemptions, f"{context}: nothing was evicted"
    assert {k: o.generated_tokens for k, o in outputs[True].items()} == {
        k: o.generated_tokens for k, o in outputs[False].items()
    }


def test_hits_skip_prefill_tokens(llama) -> None:
    """The same prompts twice through one persistent engine: the second pass prefills 1 token per page
    holding a last prompt token, everything else comes from the prefix cache."""
    prompts = shared_prompts(1.0, 4)
    engine = build_engine(llama, greedy_config(MAX_NEW_TOKENS), ContinuousBatchingConfig(page_size=4))
    with paged_backend(llama), torch.inference_mode():
        counts = []
        for _ in range(2):
            before = engine.counters.prefill_tokens
            for i, prompt in enumerate(prompts):
                engine.add(engine.build_request(Submission(prompt, f"r{len(counts)}_{i}")))
            while engine.has_work():
                engine.step()
                engine.check_integrity()
            counts.append(engine.counters.prefill_tokens - before)
    total = sum(len(p) for p in prompts)
    assert counts[0] < total  # the 12 shared tokens are computed once (requests run one after the other)
    # Second pass: every full page before the last token's page hits.
    assert counts[1] == sum(len(p) - (len(p) - 1) // 4 * 4 for p in prompts)
    assert engine.scheduler.pages.prefix.stats.hit_rate > 0.5


def check_shared_prefix_parity(model, references: ReferenceCache, label: str, max_new_tokens: int) -> None:
    """Prompts sharing prefixes, queued in admission order through one engine (page size 4, 16-token steps,
    integrity checked after every step): later requests hit the first's pages, and every output equals
    `generate()`'s."""
    prompts = shared_prompts(1.0, 4) + shared_prompts(0.5, 4, seed=1)
    engine = build_engine(
        model, greedy_config(max_new_tokens), ContinuousBatchingConfig(page_size=4, max_batch_tokens=16)
    )
    requests = [engine.build_request(Submission(p, f"req_{i}")) for i, p in enumerate(prompts)]
    with engine.session():
        for request in engine.admission_order(requests):
            engine.add(request)
        while engine.has_work():
            engine.step()
            engine.check_integrity()
    outputs = {r.request_id: r.to_output() for r in requests}
    check_parity(model, prompts, outputs, [references.get(p) for p in prompts], label)
    assert engine.scheduler.pages.prefix.stats.hit_tokens > 0


@pytest.mark.parametrize("family", ["qwen2_sliding", "mistral", "gemma2"])
def test_sliding_and_hybrid_models_share_and_match_generate(family) -> None:
    """Hits on sliding groups take only the window's pages (window 8 < the shared 12 tokens)."""
    model = build_tiny_model(family)
    refs = ReferenceCache(model, MAX_NEW_TOKENS)
    check_shared_prefix_parity(model, refs, f"{family} sharing", MAX_NEW_TOKENS)


# -- property: random prompt sets from a few shared prefixes ---------------------------------------


@st.composite
def prefix_workloads(draw: st.DrawFn) -> dict:
    page_size = draw(st.sampled_from([4, 16, 32, 64]))  # 32 and 64: prefixes shorter than a page, copied
    num_prefixes = draw(st.integers(1, 3))
    rng = random.Random(draw(st.integers(0, 10_000)))
    prefixes = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(0, 40))] for _ in range(num_prefixes)]
    prompts = []
    for _ in range(draw(st.integers(2, 7))):
        prefix = prefixes[rng.randrange(num_prefixes)]
        prompts.append(prefix + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 12))])
    tight = draw(st.booleans())
    num_blocks = tight_num_blocks(prompts, MAX_NEW_TOKENS, page_size) + 1 if tight else None
    return {
        "prompts": prompts,
        "page_size": page_size,
        "max_batch_tokens": draw(st.sampled_from([8, 24, 64])),
        "num_blocks": num_blocks,
        "max_new": [rng.randint(1, MAX_NEW_TOKENS) for _ in prompts],
    }


@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(workload=prefix_workloads())
def test_random_shared_prefixes_property(llama, references, workload) -> None:
    config = ContinuousBatchingConfig(
        page_size=workload["page_size"],
        max_batch_tokens=workload["max_batch_tokens"],
        num_blocks=workload["num_blocks"],
    )
    engine = build_engine(llama, greedy_config(MAX_NEW_TOKENS), config)
    prompts, max_new = workload["prompts"], workload["max_new"]
    requests = [
        engine.build_request(Submission(p, f"req_{i}", max_new_tokens=max_new[i]))
        for i, p in enumerate(prompts)
    ]
    finished: list[str] = []
    with paged_backend(llama), torch.inference_mode():
        for request in engine.admission_order(requests):
            engine.add(request)
        while engine.has_work():
            finished.extend(r.request_id for r in engine.step().finished)
            engine.check_integrity()
    assert sorted(finished) == sorted(r.request_id for r in requests)
    outputs = {r.request_id: r.to_output() for r in requests}
    expected = [references.get(p, n) for p, n in zip(prompts, max_new, strict=True)]
    check_parity(llama, prompts, outputs, expected, str(workload), max_new_tokens=max_new)
    pools = engine.scheduler.pages.pools
    assert all(pool.num_used_pages == 0 for pool in pools)


# -- forks ---------------------------------------------------------------------------------------


def test_greedy_forks_are_equal_copies_of_generate(llama, references) -> None:
    prompts = shared_prompts(0.5, 4)[:3]
    outputs = llama.generate_batch(
        prompts,
        greedy_config(MAX_NEW_TOKENS),
        continuous_batching_config=ContinuousBatchingConfig(page_size=4),
        num_return_sequences=3,
        progress_bar=False,
    )
    assert list(outputs) == [
        name for i in range(3) for name in (f"req_{i}__child#0", f"req_{i}__child#1", f"req_{i}")
    ]
    for i, prompt in enumerate(prompts):
        family = [outputs[f"req_{i}"], outputs[f"req_{i}__child#0"], outputs[f"req_{i}__child#1"]]
        assert all(o.status == RequestStatus.FINISHED and o.prompt_ids == prompt for o in family)
        assert all(o.generated_tokens == references.get(prompt) for o in family)


def sampled_forks(model, seed: int) -> dict[str, list[int]]:
    config = GenerationConfig(
        do_sample=True, top_k=0, max_new_tokens=MAX_NEW_TOKENS, num_return_sequences=4, eos_token_id=None
    )
    outputs = model.generate_batch(
        [list(range(3, 30))],
        config,
        continuous_batching_config=ContinuousBatchingConfig(page_size=4, seed=seed),
        progress_bar=False,
    )
    return {k: o.generated_tokens for k, o in outputs.items()}


def test_sampled_forks_are_reproducible_and_differ(llama) -> None:
    first, again, other = sampled_forks(llama, 1), sampled_forks(llama, 1), sampled_forks(llama, 2)
    assert first == again
    assert first != other
    assert len({tuple(tokens) for tokens in first.values()}) > 1  # the siblings draw their own tokens


def test_forks_share_pages_while_they_run(llama) -> None:
    engine = build_engine(llama, greedy_config(4), ContinuousBatchingConfig(page_size=4))
    parent = engine.build_request(Submission(list(range(3, 21)), "p", num_return_sequences=3))  # 18 tokens
    assert [r.request_id for r in parent.family] == ["p", "p__child#0", "p__child#1"]
    with paged_backend(llama), torch.inference_mode():
        engine.add(parent)
        engine.step()  # the parent's prefill; the siblings fork right after it
        engine.check_integrity()
        pool = engine.scheduler.pages.pools[0]
        shared = page_ids(parent)[:4]
        assert all(pool.refcount(p) == 3 for p in shared)
        assert all(page_ids(child)[:4] == shared for child in parent.siblings)
        assert pool.num_used_pages == 5 + 2  # 4 shared pages + one copy of the partial page each
        while engine.has_work():
            engine.step()
            engine.check_integrity()
    assert len({tuple(r.generated_ids) for r in parent.family}) == 1
    assert pool.num_used_pages == 0


def test_sharing_off_runs_forks_as_independent_requests(llama, references) -> None:
    prompt = shared_prompts(0.0, 4)[0]
    outputs = llama.generate_batch(
        [prompt],
        greedy_config(MAX_NEW_TOKENS),
        continuous_batching_config=ContinuousBatchingConfig(page_size=4, allow_block_sharing=False),
        num_return_sequences=2,
        progress_bar=False,
    )
    assert [o.generated_tokens for o in outputs.values()] == [references.get(prompt)] * 2


def system_prompted(page_size: int, seed: int = 1) -> list[list[int]]:
    """Six prompts after one 50-token system prompt: shorter than a page of `page_size` (64)."""
    rng = random.Random(seed)
    system = [rng.randrange(3, VOCAB) for _ in range(50)]
    return [system + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 30))] for _ in range(6)]


@pytest.mark.parametrize("pressure", ["roomy", "chunked", "evicting"])
def test_a_prefix_shorter_than_a_page_is_copied_and_matches_generate(pressure) -> None:
    """Partial-page hits (kv/prefix_cache.py): requests after the first copy the first 48 tokens of its
    page instead of computing them. Attention sharpened (a wrong key or position changes tokens); all at
    once through `generate_batch` (later ones hit pages the first ones are still filling), and one after
    another through one engine; sharing on and off give `generate()`'s tokens."""
    model = sharpen_attention(tiny_llama(seed=4))
    references = ReferenceCache(model, MAX_NEW_TOKENS)
    page_size = 64
    prompts = system_prompted(page_size)
    cb_kwargs: dict = {"page_size": page_size, "max_batch_tokens": 40}
    if pressure == "chunked":
        cb_kwargs["max_batch_tokens"] = 16
    elif pressure == "evicting":
        cb_kwargs["num_blocks"] = tight_num_blocks(prompts, MAX_NEW_TOKENS, page_size) + 1
    expected = [references.get(p) for p in prompts]
    for sharing in (False, True):
        outputs, _ = run(model, prompts, sharing, **cb_kwargs)
        check_parity(model, prompts, outputs, expected, f"{pressure} sharing={sharing}")
        got = [outputs[f"req_{i}"].generated_tokens for i in range(len(prompts))]
        assert got == expected, f"{pressure} sharing={sharing}"  # float32: exact
    engine = build_engine(model, greedy_config(MAX_NEW_TOKENS), ContinuousBatchingConfig(**cb_kwargs))
    with paged_backend(model), torch.inference_mode():
        requests = []
        for i, prompt in enumerate(prompts):
            requests.append(engine.build_request(Submission(prompt, f"req_{i}")))
            engine.add(requests[-1])
            engine.step()
            engine.check_integrity()
        while engine.has_work():
            engine.step()
            engine.check_integrity()
    assert [list(r.generated_ids) for r in requests] == expected
    if pressure != "evicting":  # each later request copies the 48 tokens of the first one's page
        assert engine.scheduler.pages.prefix.stats.hit_tokens >= 5 * 48


def test_an_idle_engine_holds_no_page_for_a_copy(llama, references) -> None:
    """A partial-page hit's copy keeps its source page pinned until the plan holding the copy has run. A request
    that ends in the step of its copy (one new token) left the source pinned until some next step: an idle
    engine held a page (`num_used_pages` 1 after every request ended; found by the property test above)."""
    rng = random.Random(3)
    prefix = [rng.randrange(3, VOCAB) for _ in range(20)]
    prompts = [
        prefix + [rng.randrange(3, VOCAB) for _ in range(4)],
        prefix + [rng.randrange(3, VOCAB) for _ in range(3)],
    ]
    engine = build_engine(
        llama, greedy_config(MAX_NEW_TOKENS), ContinuousBatchingConfig(page_size=32, max_batch_tokens=64)
    )
    pool = engine.scheduler.pages.pools[0]
    with paged_backend(llama), torch.inference_mode():
        for i, (prompt, max_new) in enumerate(zip(prompts, (2, 1), strict=True)):
            request = engine.build_request(Submission(prompt, f"req_{i}", max_new_tokens=max_new))
            engine.add(request)
            while engine.has_work():
                engine.step()
                engine.check_integrity()
            assert request.generated_ids == references.get(prompt, max_new)
            assert pool.num_used_pages == 0, f"request {i}: a page is still held"
    assert (
        engine.scheduler.pages.prefix.stats.hit_tokens > 0
    )  # the second request did copy the first's tokens
