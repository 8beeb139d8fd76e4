"""The draft model's planner (scheduler/speculation/shadow_planner.py), torch-free, over a fake executor: it decides
every step (catch-up chunks within the token budget, then batched one-token draft steps) and the
rollback of rejected draft tokens (pages released here, the rows' columns handed to the executor with
the end pages), and hands the executor rows to release when a shadow goes; drafts come back as data."""

from __future__ import annotations

from contextlib import nullcontext

from transformers_cb.kv.layer_groups import FULL_ATTENTION, KVGroupSpec
from transformers_cb.kv.page_manager import PageManager
from transformers_cb.kv.page_policies import FullAttentionPolicy
from transformers_cb.kv.pool import PagePool
from transformers_cb.requests import Request
from transformers_cb.scheduler.speculation.assisted import AssistantSchedule
from transformers_cb.scheduler.speculation.back_off import SpeculationState
from transformers_cb.scheduler.speculation.shadow_planner import ShadowPlanner
from transformers_cb.scheduler.step_plan import ScheduledRequest

DRAFT = 3


class FakeExecutor:
    """Runs nothing: a shadow's next token is a function of its tokens so far; records what it was told."""

    def __init__(self) -> None:
        self.steps: list[list[tuple[str, int, int]]] = []
        self.released: list[str] = []
        self.taken_back: list[tuple[str, list[int]]] = []

    def forward(self, entries: list[ScheduledRequest]) -> dict[str, tuple[int, float]]:
        self.steps.append([(e.request.request_id, e.start, e.num_tokens) for e in entries])
        return {
            e.request.request_id: (100 + sum(e.request.all_token_ids[: e.end]) % 50, 1.0)
            for e in entries
            if e.end == e.request.num_tokens
        }

    def release(self, shadow: Request) -> None:
        self.released.append(shadow.request_id)

    def take_back(self, shadow: Request, end_pages) -> None:
        self.taken_back.append((shadow.request_id, list(end_pages)))

    def attention(self):
        return nullcontext()

    def check_rows(self, shadows: list[Request]) -> None:
        pass


def planner(
    num_pages: int = 16, max_batch_tokens: int = 8
) -> tuple[ShadowPlanner[FakeExecutor], FakeExecutor]:
    pages = PageManager([FullAttentionPolicy(PagePool(num_pages), 4)], [KVGroupSpec(FULL_ATTENTION, (0,))])
    executor = FakeExecutor()
    return ShadowPlanner(pages, executor, max_batch_tokens), executor


def decoding(source: ShadowPlanner, request_id: str, prompt: list[int]) -> Request:
    request = Request(request_id, prompt, max_new_tokens=50)
    request.append_token(9)
    request.num_computed_tokens = request.num_tokens - 1
    request.speculation = SpeculationState(
        DRAFT, source, 2, assistant=AssistantSchedule(confidence=0.0, length=DRAFT)
    )
    return request


def expected_draft(tokens: list[int]) -> list[int]:
    tokens, draft = list(tokens), []
    for _ in range(DRAFT):
        draft.append(100 + sum(tokens) % 50)
        tokens.append(draft[-1])
    return draft


def test_catch_up_then_draft_steps_and_a_rollback_the_executor_runs() -> None:
    source, executor = planner()
    a = decoding(source, "a", list(range(1, 11)))  # 11 tokens: a catch-up of two chunks (budget 8)
    drafts = source.propose([a])
    assert drafts == {"a": expected_draft(a.all_token_ids)}
    # Catch-up chunks of 8 then 3 tokens, then DRAFT - 1 one-token steps; nothing rolled back yet.
    assert executor.steps == [[("a", 0, 8)], [("a", 8, 3)], [("a", 11, 1)], [("a", 12, 1)]]
    assert source.forwards == 4 and executor.taken_back == []
    shadow = source.sequences["a"].shadow
    assert shadow.num_computed_tokens == a.num_tokens + DRAFT - 1 == 13
    source.check_integrity()
    # The target accepts the first draft token and says 1 instead of the second: the shadow keeps 12
    # tokens of KV (a's 11 and the accepted one); its fourth page goes back, the rows forget it.
    a.append_token(drafts["a"][0])
    a.append_token(1)
    a.num_computed_tokens = a.num_tokens - 1
    executor.steps.clear()
    drafts = source.propose([a])
    assert executor.taken_back == [("a", [3])]
    assert drafts == {"a": expected_draft(a.all_token_ids)}
    assert executor.steps[0] == [("a", 12, 1)]  # the catch-up: the target's own token
    source.check_integrity()
    source.stopped(a)
    assert executor.released == ["a"] and source.num_used_pages == 0 and not source.sequences


def test_requests_of_other_sources_or_not_drafting_now_get_nothing() -> None:
    source, executor = planner()
    a, b = decoding(source, "a", [5, 6, 7]), decoding(source, "b", [1, 2])
    lookup = Request("c", [1, 2, 3], max_new_tokens=50)
    assert set(source.propose([a, b, lookup])) == {"a", "b"}
    assert executor.steps[0] == [("a", 0, 4), ("b", 0, 3)]  # batched catch-ups
    b.speculation.paused_steps = 1
    assert set(source.propose([a, b])) == {"a"}
    assert set(source.propose([a])) == {"a"} and executor.released == ["b"]  # b stopped running


def test_a_shadow_that_finds_no_page_is_dropped_and_drafts_nothing() -> None:
    source, executor = planner(num_pages=3)  # 12 tokens
    big, small = decoding(source, "big", list(range(1, 20))), decoding(source, "small", [1, 2])
    drafts = source.propose([big, small])
    assert "big" not in drafts and "big" not in source.sequences and len(drafts["small"]) == DRAFT
    source.check_integrity()


def test_a_failed_draft_costs_only_the_drafts() -> None:
    source, executor = planner()
    a = decoding(source, "a", [5, 6, 7])
    source.propose([a])

    def fail(entries):
        raise RuntimeError("device lost")

    executor.forward = fail
    a.append_token(1)
    a.num_computed_tokens = a.num_tokens - 1
    assert source.propose([a]) == {}
    assert not source.sequences and source.num_used_pages == 0
