"""The draft model's source (scheduler/speculation/shadow_planner.py planning, runner/drafter.py running): its drafts are the assistant's own greedy continuation (`generate()`) of
each request's tokens, step after step while the target accepts some draft tokens and rejects the rest (the
rejected ones' KV rolled back), with catch-ups chunked to the token budget and several requests batched;
its pages go back when a request is forgotten, and a drafter out of pages drafts nothing instead of failing.
The drafts come back as data (`{request id: tokens}`)."""

from __future__ import annotations

import random

from transformers import GenerationConfig

from tests.support.models import first_layers, tiny_llama
from tests.support.prompts import random_prompts
from tests.support.reference import greedy_reference
from transformers_cb import ContinuousBatchingConfig
from transformers_cb.engine.build import build_engine
from transformers_cb.requests import Request
from transformers_cb.scheduler.speculation.assisted import AssistantSchedule
from transformers_cb.scheduler.speculation.back_off import SpeculationState

DRAFT = 5
# Larger weights than the default: the random model's tokens then depend on its context (the KV), not only
# on its last token, so a drafter that kept stale KV would draft other tokens.
INIT_RANGE = 0.3


def drafting_engine(assistant_layers: int = 1, **cb):
    model = tiny_llama(seed=0, initializer_range=INIT_RANGE)
    model.generation_config.eos_token_id = None
    assistant = first_layers(model, assistant_layers)
    config = ContinuousBatchingConfig(**{"page_size": 4, "max_batch_tokens": 16, "num_blocks": 64, **cb})
    engine = build_engine(model, GenerationConfig(max_new_tokens=64), config, assistant_model=assistant)
    return engine, assistant


def decoding_request(engine, request_id: str, prompt: list[int], first: int) -> Request:
    """A request in the state the drafter sees it: decoding, its last token not run yet."""
    request = Request(request_id=request_id, prompt_ids=list(prompt), max_new_tokens=200)
    request.append_token(first)
    request.num_computed_tokens = request.num_tokens - 1
    schedule = AssistantSchedule(confidence=0.0, length=DRAFT)
    request.speculation = SpeculationState(DRAFT, engine.drafter, 2, assistant=schedule)
    return request


def test_drafts_are_the_assistants_greedy_tokens_through_accepts_and_rejects() -> None:
    engine, assistant = drafting_engine()
    drafter = engine.drafter
    rng = random.Random(0)
    # Prompts longer than the token budget (16): the first catch-ups are chunked.
    prompts = random_prompts(3, 300, 9, 30, seed=4)
    requests = [
        decoding_request(engine, f"r{i}", prompt, rng.randrange(300)) for i, prompt in enumerate(prompts)
    ]
    forwards = []
    for round_ in range(8):
        before = drafter.forwards
        drafts = drafter.draft(requests)
        forwards.append(drafter.forwards - before)
        drafter.check_integrity()
        for request in requests:
            expected = greedy_reference(assistant, request.all_token_ids, DRAFT)
            assert drafts[request.request_id] == expected, (round_, request.request_id)
            # Its shadow holds the request's tokens and the draft's first DRAFT - 1 (rolled back if rejected).
            shadow = drafter.sequences[request.request_id].shadow
            assert shadow.num_computed_tokens == request.num_tokens + DRAFT - 1
        # The target's verdict: some draft tokens accepted, then its own token (a rejection unless all
        # were accepted); now and then a request is not stepped at all.
        for request in requests:
            if rng.random() < 0.2:
                continue
            draft = drafts[request.request_id]
            accepted = rng.randint(0, len(draft))
            for token in draft[:accepted]:
                request.append_token(token)
            own = rng.randrange(300) if accepted < len(draft) else draft[-1]
            if accepted < len(draft) and own == draft[accepted]:
                own = (own + 1) % 300
            request.append_token(own)
            request.num_computed_tokens = request.num_tokens - 1
    # The first round's catch-ups did not fit one forward; later rounds: a catch-up and DRAFT - 1 steps.
    assert forwards[0] > DRAFT
    assert all(count == DRAFT for count in forwards[1:])
    for request in requests:
        drafter.stopped(request)
    assert drafter.num_used_pages == 0 and not drafter.sequences
    drafter.check_integrity()


def test_requests_not_running_or_not_decoding_get_no_draft_and_lose_their_shadow() -> None:
    engine, _assistant = drafting_engine()
    drafter = engine.drafter
    a, b = decoding_request(engine, "a", [5, 6, 7, 8], 9), decoding_request(engine, "b", [1, 2, 3], 4)
    drafts = drafter.draft([a, b])
    assert drafts["a"] and drafts["b"] and drafter.num_used_pages > 0
    b.num_computed_tokens = 0  # preempted: it recomputes; a paused request drafts nothing either
    a.speculation.paused_steps = 1
    assert drafter.draft([a, b]) == {}
    drafter.draft([a])  # b is no longer running: its shadow goes
    assert set(drafter.sequences) == {"a"}
    a.speculation.paused_steps = 0
    a.max_new_tokens = len(a.generated_ids) + 3  # room for 2 draft tokens before the target's last one
    assert len(drafter.draft([a])["a"]) == 2
    drafter.check_integrity()


def test_a_drafter_out_of_pages_drafts_nothing() -> None:
    engine, _assistant = drafting_engine(num_blocks=6)  # 24 tokens in each cache
    drafter = engine.drafter
    big = decoding_request(engine, "big", list(range(10, 40)), 3)  # 31 tokens: more than the drafter holds
    small = decoding_request(engine, "small", [5, 6, 7], 8)
    drafts = drafter.draft([big, small])
    assert "big" not in drafts and "big" not in drafter.sequences
    assert len(drafts["small"]) == DRAFT
    drafter.check_integrity()
