"""Greedy parity under heavy memory pressure with CPU offload (the host KV tier) on and off.

Every family the suite runs (full attention, sliding and hybrid, chunked: Llama 4) on its paged backend x page sizes {4, 16}:
8 requests on a device cache holding about a quarter of their working set (never less than the largest
request + 1 page), chunked prefill (16 tokens per step). With offload on and a host tier big enough
(`cpu_offload_space=None`, capped to what the work can use), preempted requests swap out and back:
`recomputed_tokens == 0`. With it off they recompute. Both equal `generate()` token for token, and the
engine's integrity check (device pools, host pools, queues, block tables) runs after every step.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

import pytest

from conformance.common import ReferenceCache, check_parity, count_preemptions, greedy_config, run_batch
from tests.support.models import (
    FAMILIES,
    SLIDING_FAMILIES,
    backends_for,
    build_tiny_model,
    using_backend,
    vocab_size,
)
from tests.support.prompts import random_prompts
from transformers_cb import ContinuousBatchingConfig
from transformers_cb.engine.engine import Engine
from transformers_cb.kv.layer_groups import kv_groups_from_config
from transformers_cb.memory.sizing import max_pages_held
from transformers_cb.scheduler.recompute import RecomputeCounter

MAX_NEW_TOKENS = 12
PAGE_SIZES = (4, 16)
BUDGET = 16  # tokens per step: chunked prefill, so requests are also preempted between chunks
ALL_FAMILIES = (*FAMILIES, *SLIDING_FAMILIES, "llama4")  # llama4: chunked + full NoPE layers


def pressure_num_blocks(model, prompts: list[list[int]], page_size: int) -> int:
    """About a quarter of the pages all requests hold at once at full length (in the group that needs
    most: a sliding group holds only its window), never below the largest request + 1 page."""
    groups = kv_groups_from_config(model.config)
    lengths = [len(p) + MAX_NEW_TOKENS for p in prompts]
    need = max(sum(max_pages_held(g, n, page_size, BUDGET) for n in lengths) for g in groups)
    largest = max(max_pages_held(g, n, page_size, BUDGET) for g in groups for n in lengths)
    return max(largest + 1, math.ceil(need / 4))


@contextmanager
def engines_checked() -> Iterator[list[Engine]]:
    """Record the engine and run its integrity check after every step."""
    engines: list[Engine] = []
    original = Engine.step

    def step(self):
        result = original(self)
        self.check_integrity()
        if not engines or engines[-1] is not self:
            engines.append(self)
        return result

    with mock.patch.object(Engine, "step", step):
        yield engines


@contextmanager
def dropped_tokens() -> Iterator[list[int]]:
    """The computed tokens each preemption dropped (recompute). Not the scheduler's `recomputed`, which
    counts only the tokens run again: a returning request may find all it had in the prefix cache (a
    request preempted with whole pages only, at page_size 16) and run nothing again."""
    dropped: list[int] = []
    original = RecomputeCounter.dropped

    def count(self, request_id, num_computed_tokens):
        dropped.append(num_computed_tokens)
        return original(self, request_id, num_computed_tokens)

    with mock.patch.object(RecomputeCounter, "dropped", count):
        yield dropped


@pytest.fixture(scope="module")
def _families() -> dict:
    return {}


@pytest.mark.parametrize("page_size", PAGE_SIZES, ids=lambda p: f"page{p}")
@pytest.mark.parametrize("family_name", ALL_FAMILIES)
def test_parity_with_offload_on_and_off(_families, family_name: str, page_size: int) -> None:
    if family_name not in _families:
        model = build_tiny_model(family_name, seed=0)
        prompts = random_prompts(8, vocab_size(model), 1, 40, seed=1)
        _families[family_name] = (model, prompts, ReferenceCache(model, MAX_NEW_TOKENS))
    model, prompts, references = _families[family_name]
    expected = [references.get(p) for p in prompts]
    backend = backends_for(family_name)[0]  # paged|sdpa, or paged|eager where sdpa is refused
    num_blocks = pressure_num_blocks(model, prompts, page_size)
    for offload in (0.0, None):
        context = f"{family_name} / {backend} / page_size={page_size}, num_blocks={num_blocks}, cpu_offload_space={offload}"
        with (
            using_backend(model, family_name, backend),
            engines_checked() as engines,
            dropped_tokens() as dropped,
        ):
            outputs, preemptions = run_batch(
                model,
                prompts,
                greedy_config(MAX_NEW_TOKENS),
                page_size=page_size,
                max_batch_tokens=BUDGET,
                num_blocks=num_blocks,
                cpu_offload_space=offload,
            )
            check_parity(model, prompts, outputs, expected, context)
        (engine,) = engines
        assert preemptions, f"{context}: nothing was preempted; the test does not exercise offload"
        recomputed = engine.scheduler.recomputed.total
        if offload is None:
            assert engine.offload is not None and engine.offload.swap_out_pages > 0, context
            assert recomputed == 0, f"{context}: {recomputed} tokens recomputed with a big enough host tier"
            assert sum(dropped) == 0, f"{context}: {dropped} tokens dropped with a big enough host tier"
            assert engine.offload.swap_in_pages == engine.offload.swap_out_pages, context
            assert engine.offload.host.num_used_pages == 0, context
        else:
            assert engine.offload is None and sum(dropped) > 0, context


@pytest.mark.parametrize("page_size", PAGE_SIZES, ids=lambda p: f"page{p}")
@pytest.mark.parametrize("family_name", ["llama", "gemma3"])  # full attention; hybrid (5 sliding : 1 full)
def test_offload_with_shared_prefixes_and_forks(_families, family_name: str, page_size: int) -> None:
    """Prefix sharing (on by default) and forks under the same pressure: requests share their prompts'
    first pages, so swap-outs leave shared pages resident and copy only their own. Outputs equal
    `generate()` (every fork of a greedy request equals it), nothing is recomputed, shared pages were
    kept at least once, and both tiers end empty."""
    model = build_tiny_model(family_name, seed=0)
    vocab = vocab_size(model)
    prefix = random_prompts(1, vocab, 3 * page_size, 3 * page_size, seed=3)[0]
    prompts = [prefix + suffix for suffix in random_prompts(6, vocab, 1, 12, seed=4)]
    references = ReferenceCache(model, MAX_NEW_TOKENS)
    num_blocks = pressure_num_blocks(model, prompts * 2, page_size)
    context = f"{family_name} / page_size={page_size}, num_blocks={num_blocks}"
    backend = backends_for(family_name)[0]
    cb_config = ContinuousBatchingConfig(
        page_size=page_size, max_batch_tokens=BUDGET, num_blocks=num_blocks, cpu_offload_space=None
    )
    with (
        using_backend(model, family_name, backend),
        engines_checked() as engines,
        count_preemptions() as preemptions,
    ):
        outputs = model.generate_batch(
            prompts,
            greedy_config(MAX_NEW_TOKENS),
            continuous_batching_config=cb_config,
            num_return_sequences=2,
            progress_bar=False,
        )
    (engine,) = engines
    assert preemptions, f"{context}: nothing was preempted"
    for i, prompt in enumerate(prompts):
        expected = references.get(prompt)
        for rid in (f"req_{i}", f"req_{i}__child#0"):
            assert outputs[rid].generated_tokens == expected, f"{context}: {rid}"
    offload = engine.offload
    assert engine.scheduler.recomputed.total == 0, context
    assert offload.swap_out_pages > 0 and offload.kept_pages > 0, f"{context}: no shared page was kept"
    assert offload.host.num_used_pages == 0 and engine.num_used_pages == 0, context
