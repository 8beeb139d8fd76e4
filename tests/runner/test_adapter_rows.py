"""The step's adapter row groups (runner/adapter_rows.py): each request's contiguous rows grouped by its
`AdapterChoice`, over the packed tokens and over the rows the head keeps; a step where every request runs the
model's own forwards sets nothing; a layer called on a row count that is neither is an error, never a guess."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from transformers_cb.invariants import InvariantError
from transformers_cb.requests import AdapterChoice, Request
from transformers_cb.runner.adapter_rows import step_adapters

A, B = AdapterChoice(("a",)), AdapterChoice(("b",), 2)


def _request(name: str, choice: AdapterChoice | None) -> Request:
    request = Request(name, [1, 2, 3], 4)
    request.adapter = choice
    return request


def _rows(groups) -> dict:
    return {g.choice: (None if g.rows is None else g.rows.tolist()) for g in groups}


def test_rows_are_grouped_by_choice_over_tokens_and_kept_rows() -> None:
    requests = [_request("r0", A), _request("r1", None), _request("r2", B), _request("r3", A)]
    keep = torch.tensor([1, 2, 5, 7])  # the last token of each request: 2, 1, 3, 2 tokens
    head = nn.Linear(2, 2)
    step = step_adapters(requests, [2, 1, 3, 2], keep, head)
    assert step is not None
    assert _rows(step.groups_for(nn.Linear(2, 2), 8)) == {A: [0, 1, 6, 7], None: [2], B: [3, 4, 5]}
    assert _rows(step.groups_for(head, 4)) == {A: [0, 3], None: [1], B: [2]}
    with pytest.raises(InvariantError, match="called on 5 rows"):
        step.groups_for(nn.Linear(2, 2), 5)


def test_one_choice_is_one_group_of_every_row_and_none_sets_nothing() -> None:
    step = step_adapters([_request("r0", B), _request("r1", B)], [3, 1], torch.tensor([2, 3]), None)
    assert step is not None and _rows(step.token_groups) == {B: None} and _rows(step.kept_groups) == {B: None}
    assert step_adapters([_request("r0", None)], [3], torch.tensor([2]), None) is None


def test_the_salt_differs_by_adapter_and_version() -> None:
    salts = {AdapterChoice(()).salt(), A.salt(), AdapterChoice(("a",), 1).salt(), B.salt()}
    assert len(salts) == 4
