"""Greedy parity on sliding-window and hybrid models: `generate_batch` equals `generate()` token for token.

Families (see `tests.support.models.FAMILY_CONFIGS`): Mistral (every layer sliding), Qwen2 with
`use_sliding_window`, Gemma 2 (alternating, logit softcaps, query_pre_attn_scalar), Gemma 3 text
(5 sliding : 1 full, local RoPE), Cohere2 (3 : 1) and GPT-OSS (alternating, attention sinks), each with a window of 8 tokens,
shorter than most prompts (1..40 tokens). Each runs under its paged backends and its plain backend
(switched to paged for the run) x page sizes {4, 16} x token budgets (5: chunks start inside and cross
the window boundary; default) x a cache small enough to force preemption. Sliding groups' pages are
recycled while running, and the engine's integrity check (which bounds them) runs after every step.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from unittest import mock

import pytest
from transformers import PreTrainedModel

from conformance.common import ReferenceCache, check_parity, greedy_config, run_batch, tight_num_blocks
from tests.support.models import SLIDING_FAMILIES, backends_for, build_tiny_model, using_backend, vocab_size
from tests.support.prompts import random_prompts
from transformers_cb.engine.engine import Engine

MAX_NEW_TOKENS = 12
PAGE_SIZES = (4, 16)
BUDGETS = (5, None)  # 5 < window: every prefill chunk after the first starts inside the window


@dataclass
class Family:
    name: str
    model: PreTrainedModel
    references: ReferenceCache
    prompts: list[list[int]]

    def backend(self, attn_implementation: str) -> AbstractContextManager[PreTrainedModel]:
        return using_backend(self.model, self.name, attn_implementation)


@pytest.fixture(scope="module")
def _families() -> dict[str, Family]:
    return {}


def _family(name: str, cache: dict[str, Family]) -> Family:
    if name not in cache:
        model = build_tiny_model(name, seed=0)
        prompts = random_prompts(8, vocab_size(model), 1, 40, seed=1)
        cache[name] = Family(name, model, ReferenceCache(model, MAX_NEW_TOKENS), prompts)
    return cache[name]


@contextmanager
def integrity_checked() -> Iterator[list]:
    """Run `Engine.check_integrity()` (pools, page lists, sliding bounds) after every step."""
    steps: list = []
    original = Engine.step

    def step(self):
        result = original(self)
        self.check_integrity()
        steps.append(result)
        return result

    with mock.patch.object(Engine, "step", step):
        yield steps


CASES = [(f, b) for f in SLIDING_FAMILIES for b in backends_for(f)]


@pytest.mark.parametrize("budget", BUDGETS, ids=lambda b: f"budget{b}")
@pytest.mark.parametrize("page_size", PAGE_SIZES, ids=lambda p: f"page{p}")
@pytest.mark.parametrize(("family_name", "backend"), CASES)
def test_sliding_parity(
    _families, family_name: str, backend: str, page_size: int, budget: int | None
) -> None:
    family = _family(family_name, _families)
    references = [family.references.get(p) for p in family.prompts]
    context = f"{family_name} / {backend!r} / page_size={page_size}, max_batch_tokens={budget}"
    with family.backend(backend) as model, integrity_checked() as steps:
        outputs, _ = run_batch(
            model, family.prompts, greedy_config(MAX_NEW_TOKENS), page_size=page_size, max_batch_tokens=budget
        )
        assert steps, "the engine never stepped"
        check_parity(model, family.prompts, outputs, references, context)
        assert model.config._attn_implementation == backend, "generate_batch did not restore the backend"


@pytest.mark.parametrize("page_size", PAGE_SIZES, ids=lambda p: f"page{p}")
@pytest.mark.parametrize(("family_name", "backend"), CASES)
def test_sliding_parity_under_eviction(_families, family_name: str, backend: str, page_size: int) -> None:
    """A cache just big enough for the largest request (every group): requests are evicted and recomputed."""
    family = _family(family_name, _families)
    num_blocks = tight_num_blocks(family.prompts, MAX_NEW_TOKENS, page_size)
    references = [family.references.get(p) for p in family.prompts]
    context = (
        f"{family_name} / {backend!r} / page_size={page_size}, max_batch_tokens=16, num_blocks={num_blocks}"
    )
    with family.backend(backend) as model, integrity_checked():
        outputs, preemptions = run_batch(
            model,
            family.prompts,
            greedy_config(MAX_NEW_TOKENS),
            page_size=page_size,
            max_batch_tokens=16,
            num_blocks=num_blocks,
        )
        assert preemptions, f"{context}: no request was evicted; the test does not exercise eviction"
        check_parity(model, family.prompts, outputs, references, context)
