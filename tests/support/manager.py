"""What the manager tests share: the model and cache settings, the `generate()` references, result
collection and the checks every test makes.

Every finished greedy output is compared with plain `model.generate()` on the prompt alone, run on a
separate model instance with the same weights (the manager's model is switched to paged attention
while its thread runs). Every blocking call has a timeout so a bug fails a test instead of hanging it.
"""

from __future__ import annotations

import time
from typing import Any

from tests.support.models import tiny_llama_without_eos
from tests.support.prompts import prompts_of_lengths
from tests.support.reference import greedy_reference
from tests.support.threads import TIMEOUT
from transformers_cb import (
    ContinuousBatchingConfig,
    ContinuousBatchingManager,
    GenerationOutput,
    RequestStatus,
)

CB_CONFIG = {"page_size": 16, "num_blocks": 64}
MANAGER_LOGGER = "transformers_cb.manager.manager"
PROMPTS = prompts_of_lengths([4, 7, 11, 5, 9, 13, 6, 8], seed=1)


def make_model(seed: int = 0):
    return tiny_llama_without_eos(seed=seed)


class References:
    """Greedy `generate()` tokens per prompt, cached; shorter lengths are prefixes of longer runs (no eos)."""

    def __init__(self, model) -> None:
        self.model = model
        self._cache: dict[tuple[int, ...], list[int]] = {}

    def __call__(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        key = tuple(prompt)
        cached = self._cache.get(key, [])
        if len(cached) < max_new_tokens:
            cached = greedy_reference(self.model, list(prompt), max(max_new_tokens, 8))
            self._cache[key] = cached
        return cached[:max_new_tokens]


def new_manager(model, **config: Any) -> ContinuousBatchingManager:
    return model.init_continuous_batching(
        continuous_batching_config=ContinuousBatchingConfig(**{**CB_CONFIG, **config})
    )


def collect(manager: ContinuousBatchingManager, ids, timeout: float = TIMEOUT) -> dict[str, GenerationOutput]:
    """The final results of `ids` from `get_result()`; each exactly once."""
    wanted, results = set(ids), {}
    deadline = time.monotonic() + timeout
    while wanted - results.keys():
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"no final result for {sorted(wanted - results.keys())}"
        output = manager.get_result(timeout=remaining)
        if output is None:
            continue
        assert output.is_finished(), output
        assert output.request_id not in results, f"second final result for {output.request_id}"
        results[output.request_id] = output
    assert results.keys() == wanted, f"unexpected results {sorted(results.keys() - wanted)}"
    return results


def assert_finished_like_generate(output: GenerationOutput, ref: References, prompt, max_new_tokens) -> None:
    assert output.status == RequestStatus.FINISHED, (output.status, output.error)
    assert output.error is None
    assert output.prompt_ids == list(prompt)
    assert output.generated_tokens == ref(prompt, max_new_tokens)


def assert_no_leak(manager: ContinuousBatchingManager) -> None:
    """Integrity of the pages; all of them free when no request is live. Holds the loop while checking."""
    with manager.pause():
        engine = manager.engine
        engine.check_integrity()
        if not engine.has_work():
            assert engine.num_used_pages == 0


def partial_lengths_ok(outputs: list[GenerationOutput]) -> None:
    """Streaming outputs: partials grow by exactly one token, each a prefix of the final."""
    *partials, final = outputs
    assert final.is_finished()
    assert all(not p.is_finished() for p in partials)
    lengths = [len(o.generated_tokens) for o in partials]
    assert lengths == list(range(1, len(partials) + 1)), lengths
    for partial in partials:
        assert final.generated_tokens[: len(partial.generated_tokens)] == partial.generated_tokens
