"""`Request` objects for the page policy, scheduler and offload tests (no model, no tensors)."""

from __future__ import annotations

import zlib

from transformers_cb.requests import Request
from transformers_cb.scheduler.step_plan import ScheduledRequest, StepPlan

FIRST_NORMAL_TOKEN = 10  # prompt ids start here: clear of the fake model's eos (2)


def prompt_for(request_id: str, num_tokens: int) -> list[int]:
    """Token ids that depend only on (request id, position): distinct requests have distinct prompts."""
    return [FIRST_NORMAL_TOKEN + (zlib.crc32(f"{request_id}/{i}".encode()) % 200) for i in range(num_tokens)]


def make_request(
    request_id: str = "r",
    num_prompt_tokens: int = 4,
    max_new_tokens: int = 4,
    eos: frozenset[int] = frozenset(),
) -> Request:
    return Request(
        request_id=request_id,
        prompt_ids=prompt_for(request_id, num_prompt_tokens),
        max_new_tokens=max_new_tokens,
        eos_token_ids=eos,
    )


def page_ids(request: Request) -> list[int]:
    """The request's page ids in the first KV group (the only one on a full-attention model): the
    list itself, so appending to it corrupts the request's pages (integrity tests)."""
    return request.pages[0].page_ids if request.pages else []


def set_page_ids(request: Request, ids: list[int]) -> None:
    """Give the request these pages in the first KV group (as if allocated)."""
    request.group_pages(0).page_ids = list(ids)


def sampling_entries(plan: StepPlan) -> list[ScheduledRequest]:
    """The plan's entries that sample a token this step, in order (valid until `Scheduler.update`)."""
    return [entry for entry in plan.entries if entry.samples]
