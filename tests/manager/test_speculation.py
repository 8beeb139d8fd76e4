"""Speculating requests through the manager: each streamed output carries the tokens its step appended
(several per step), they concatenate to `generate()`'s greedy output, the logprobs equal those without
speculation (the target model's), and `stats()` counts the drafts."""

from __future__ import annotations

import math

from tests.support.manager import assert_finished_like_generate, assert_no_leak
from tests.support.threads import run_with_timeout

PATTERN = [17, 230, 45, 101, 9, 77]
PROMPT = [3, 150] + PATTERN * 4
MAX_NEW = 24


def _stream(manager, **kwargs):
    rid = manager.add_request(PROMPT, max_new_tokens=MAX_NEW, streaming=True, return_logprobs=True, **kwargs)
    return run_with_timeout(lambda: list(manager.request_id_iter(rid)))


def test_streamed_speculation_equals_plain_decoding(manager, ref):
    manager.start()
    plain = _stream(manager)
    outputs = _stream(manager, prompt_lookup_num_tokens=4)
    final = outputs[-1]
    assert_finished_like_generate(final, ref, PROMPT, MAX_NEW)
    assert [t for o in outputs for t in o.new_tokens] == final.generated_tokens
    assert [lp for o in outputs for lp in o.new_logprobs] == final.logprobs
    assert all(
        math.isclose(a, b, abs_tol=1e-4) for a, b in zip(final.logprobs, plain[-1].logprobs, strict=True)
    )
    assert final.accepted_draft_tokens > 0 and final.draft_tokens >= final.accepted_draft_tokens
    assert len(outputs) < len(plain), "no step appended more than one token"
    assert final.tokens_per_step > 1.0 and plain[-1].tokens_per_step == 1.0
    stats = manager.stats()
    assert stats.draft_tokens == final.draft_tokens
    assert stats.accepted_draft_tokens == final.accepted_draft_tokens
    assert 0 < stats.acceptance_rate <= 1 and stats.tokens_per_speculation_step > 1
    assert_no_leak(manager)
