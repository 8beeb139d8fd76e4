"""`call_model`: the step's metadata is set in the context variable for the forward's duration (and only
then), and the kept rows are selected when the model returns every position's logits."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch

from transformers_cb.attention.metadata import AttentionMetadata
from transformers_cb.attention.paged import METADATA_KWARG, current_step_metadata
from transformers_cb.invariants import InvariantError
from transformers_cb.runner.forward.model_call import call_model

TOKENS = 5
VOCAB = 7
METADATA = cast(AttentionMetadata, object())  # the glue's metadata is opaque to call_model


def logits_per_token() -> torch.Tensor:
    """Row t of every logit is t: a selected row says which token it came from."""
    return torch.arange(TOKENS, dtype=torch.float32)[:, None].expand(TOKENS, VOCAB)[None].clone()


def honouring(**kwargs: Any) -> SimpleNamespace:
    keep = kwargs["logits_to_keep"]
    return SimpleNamespace(logits=logits_per_token()[:, keep])


def ignoring(**kwargs: Any) -> SimpleNamespace:
    return SimpleNamespace(logits=logits_per_token())


def rows(logits: torch.Tensor) -> list[int]:
    return logits[:, 0].long().tolist()


def call(forward, keep: list[int], select_rows: bool = False) -> torch.Tensor:
    ids = torch.zeros(1, TOKENS, dtype=torch.int64)
    mask = torch.ones(1, 1, 1, 1, dtype=torch.bool)
    return call_model(forward, ids, ids, mask, torch.tensor(keep), METADATA, select_rows)


@pytest.mark.parametrize("forward", [honouring, ignoring], ids=["honours", "ignores"])
def test_the_kept_rows_come_back_in_keep_order(forward) -> None:
    assert rows(call(forward, [4, 1])) == [4, 1]


def test_rows_are_selected_when_their_count_equals_the_steps() -> None:
    """Every token kept (prompt logprobs, padded graph steps): the count cannot tell, the probe's flag does."""
    keep = [4, 0, 1, 2, 3]
    assert rows(call(ignoring, keep, select_rows=True)) == keep
    assert rows(call(honouring, keep, select_rows=False)) == keep
    assert rows(call(ignoring, keep, select_rows=False)) == [0, 1, 2, 3, 4]  # why the flag exists


def test_a_row_count_of_neither_kind_is_a_broken_contract() -> None:
    def three_rows(**kwargs: Any) -> SimpleNamespace:
        return SimpleNamespace(logits=logits_per_token()[:, :3])

    with pytest.raises(InvariantError, match="logits for 3 positions"):
        call(three_rows, [4, 1])


def test_the_metadata_is_in_the_context_for_the_forward_only() -> None:
    seen = []

    def forward(**kwargs: Any) -> SimpleNamespace:
        seen.append((current_step_metadata(), kwargs[METADATA_KWARG]))
        return honouring(**kwargs)

    assert current_step_metadata() is None
    call(forward, [0])
    assert seen == [(METADATA, METADATA)]
    assert current_step_metadata() is None

    def failing(**kwargs: Any) -> SimpleNamespace:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        call(failing, [0])
    assert current_step_metadata() is None  # reset on the way out
