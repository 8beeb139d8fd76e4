"""A draft model through the manager (`init_continuous_batching(assistant_model=...)`): streamed speculating
requests append several tokens per step, equal `generate()`'s greedy output, and `stats()` counts the
assistant's drafts; per-request settings ride on `add_request`; both caches are whole afterwards."""

from __future__ import annotations

from tests.support.manager import CB_CONFIG, assert_finished_like_generate, assert_no_leak, collect
from tests.support.models import first_layers
from tests.support.threads import TIMEOUT, run_with_timeout
from transformers_cb import ContinuousBatchingConfig

PATTERN = [17, 230, 45, 101, 9, 77]
PROMPT = [3, 150] + PATTERN * 4
MAX_NEW = 24


def test_manager_with_an_assistant_streams_greedy_tokens_and_counts_drafts(model, ref) -> None:
    manager = model.init_continuous_batching(
        continuous_batching_config=ContinuousBatchingConfig(**CB_CONFIG), assistant_model=model
    )
    try:
        manager.start()
        rid = manager.add_request(
            PROMPT,
            max_new_tokens=MAX_NEW,
            streaming=True,
            num_assistant_tokens=3,
            assistant_confidence_threshold=0.0,
        )
        outputs = run_with_timeout(lambda: list(manager.request_id_iter(rid)))
        final = outputs[-1]
        assert_finished_like_generate(final, ref, PROMPT, MAX_NEW)
        assert [t for o in outputs for t in o.new_tokens] == final.generated_tokens
        assert final.draft_tokens > 0 and final.accepted_draft_tokens == final.draft_tokens  # its own drafts
        assert len(outputs) < MAX_NEW // 2
        # Off for one request, and a first-layer assistant's drafts for others: same tokens either way.
        ids = [
            manager.add_request(PROMPT, max_new_tokens=MAX_NEW, num_assistant_tokens=0),
            manager.add_request(PATTERN * 3, max_new_tokens=MAX_NEW),
        ]
        results = collect(manager, ids)
        assert results[ids[0]].draft_tokens == 0
        assert_finished_like_generate(results[ids[0]], ref, PROMPT, MAX_NEW)
        assert_finished_like_generate(results[ids[1]], ref, PATTERN * 3, MAX_NEW)
        stats = manager.stats()
        assert stats.draft_tokens == final.draft_tokens + results[ids[1]].draft_tokens
        assert stats.accepted_draft_tokens >= final.accepted_draft_tokens > 0
        assert_no_leak(manager)
        with manager.pause():
            assert manager.engine.drafter.num_used_pages == 0
    finally:
        manager.stop(hard_stop=True, timeout=TIMEOUT)
        manager.destroy()


def test_context_manager_takes_an_assistant(model, ref) -> None:
    assistant = first_layers(model, 1)
    with model.continuous_batching_context_manager(
        continuous_batching_config=ContinuousBatchingConfig(**CB_CONFIG), assistant_model=assistant
    ) as manager:
        rid = manager.add_request(PROMPT, max_new_tokens=MAX_NEW, assistant_confidence_threshold=0.0)
        result = collect(manager, [rid])[rid]
    assert_finished_like_generate(result, ref, PROMPT, MAX_NEW)
    assert result.draft_tokens > 0
