"""`CBPredictor` called on batches by hand (no Ray): prompts as text, chat or token ids, per-row
parameters, refused rows, logprobs, and the row order of its output."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.ray_jobs import one_call_reference
from tests.support.serve import CHAT_TEMPLATE
from transformers_cb.jobs.prompts import chat_ids
from transformers_cb.models.tiny import TINY_MAX_POSITIONS
from transformers_cb.scale_out.predictor import OUTPUT_COLUMNS, CBPredictor

CB = {"page_size": 16, "num_blocks": 64}


@pytest.fixture(scope="module")
def predictor() -> CBPredictor:
    return CBPredictor(None, max_new_tokens=6, chat_template=CHAT_TEMPLATE, continuous_batching_config=CB)


def test_text_rows_in_order_with_per_row_max_new_tokens(predictor: CBPredictor) -> None:
    prompts = ["a longer prompt than the others", "hi", "the middle one"]
    batch = {"prompt": np.array(prompts), "max_new_tokens": np.array([3, np.nan, 5]), "key": np.arange(3)}
    out = predictor(batch)
    assert set(OUTPUT_COLUMNS) <= set(out)
    assert list(out["key"]) == [0, 1, 2] and list(out["prompt"]) == prompts  # input columns kept
    ids = [predictor.tokenizer.encode(p) for p in prompts]
    expected = one_call_reference(predictor, ids, [3, 6, 5])
    assert [list(t) for t in out["generated_token_ids"]] == expected
    assert list(out["num_generated_tokens"]) == [len(t) for t in expected]
    assert list(out["num_prompt_tokens"]) == [len(i) for i in ids]
    eos = predictor.tokenizer.eos_token_id
    reasons = ["stop" if t[-1] == eos else "length" for t in expected]
    assert list(out["finish_reason"]) == reasons
    assert list(out["status"]) == ["FINISHED"] * 3
    texts = [predictor.tokenizer.decode(t, skip_special_tokens=True) for t in expected]
    assert list(out["generated_text"]) == texts


def test_token_ids_and_chat_prompts(predictor: CBPredictor) -> None:
    token_ids = np.empty(2, dtype=object)
    token_ids[0], token_ids[1] = np.array([1, 70, 71, 72]), np.array([1, 80, 81, 82])  # equal lengths
    out = predictor({"prompt_token_ids": token_ids})
    assert [list(t) for t in out["generated_token_ids"]] == one_call_reference(
        predictor, [[1, 70, 71, 72], [1, 80, 81, 82]], [6, 6]
    )

    messages = [[{"role": "user", "content": "hello"}], [{"role": "user", "content": "bye"}]]
    chat = predictor({"messages": np.array(messages + [None], dtype=object)[:2]})
    ids = [chat_ids(predictor.tokenizer, m) for m in messages]  # the rendering every path shares
    assert [list(t) for t in chat["generated_token_ids"]] == one_call_reference(predictor, ids, [6, 6])

    wrapped = CBPredictor(
        None,
        max_new_tokens=6,
        chat_template=CHAT_TEMPLATE,
        apply_chat_template=True,
        continuous_batching_config=CB,
    )
    out = wrapped({"prompt": np.array(["hello", "bye"])})
    assert [list(t) for t in out["generated_token_ids"]] == [list(t) for t in chat["generated_token_ids"]]


def test_refused_row_fails_alone_and_logprobs(predictor: CBPredictor) -> None:
    with_logprobs = CBPredictor(None, max_new_tokens=4, return_logprobs=True, continuous_batching_config=CB)
    too_long = "x" * (TINY_MAX_POSITIONS + 1)  # past the tiny model's context
    out = with_logprobs({"prompt": np.array(["fine", too_long, "also fine"])})
    assert list(out["status"]) == ["FINISHED", "FAILED", "FINISHED"]
    assert "exceeds" in out["error"][1] and out["error"][0] is None
    assert out["finish_reason"][1] == "error" and list(out["generated_token_ids"][1]) == []
    assert [len(lp) for lp in out["logprobs"]] == [4, 0, 4]
    assert all(lp < 0 for lp in out["logprobs"][0])


def test_per_row_sampling_columns_need_per_request_processors(predictor: CBPredictor) -> None:
    with pytest.raises(ValueError, match="per_request_processors"):
        predictor({"prompt": np.array(["a", "b"]), "temperature": np.array([0.5, 1.0])})
    sampler = CBPredictor(
        None,
        max_new_tokens=5,
        generation_config={"do_sample": True, "temperature": 0.9},  # creates the processor
        continuous_batching_config={**CB, "per_request_processors": True},
    )
    batch = {"prompt": np.array(["same", "same", "same"]), "temperature": [0.7, 0.7, 0.7], "seed": [1, 1, 2]}
    out = sampler(batch)
    tokens = [list(t) for t in out["generated_token_ids"]]
    assert tokens[0] == tokens[1] and len(tokens[0]) > 0  # same seed, same prompt, same draw
    assert list(out["status"]) == ["FINISHED"] * 3


def test_missing_prompt_column_names_the_columns(predictor: CBPredictor) -> None:
    with pytest.raises(ValueError, match="no prompt column.*'text'"):
        predictor({"text": np.array(["a"])})
