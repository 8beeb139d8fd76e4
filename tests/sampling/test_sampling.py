"""Sampling: per-request parameters, batch-invariant seeds, logprobs (sampled, top-k, prompt),
stop strings and finish reasons. Greedy parity per processor is in conformance/test_processors.py,
the statistical tests of the warpers in tests/sampling/test_distributions.py."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation import logits_process as lp

from tests.support.models import tiny_llama
from tests.support.preemptions import count_preemptions
from tests.support.prompts import prompts_of_lengths
from tests.support.threads import TIMEOUT
from transformers_cb import ContinuousBatchingConfig, RequestStatus
from transformers_cb.models.tiny import build_tiny_model, build_tiny_tokenizer
from transformers_cb.sampling.logits import warpers
from transformers_cb.sampling.params import derive_seed

SAMPLED = GenerationConfig(
    max_new_tokens=6, do_sample=True, temperature=0.7, top_k=40, top_p=0.9, eos_token_id=None
)


@pytest.fixture(scope="module")
def model():
    return tiny_llama("paged|sdpa", seed=5)


def _run(model, prompts, config=SAMPLED, cb: dict | None = None, **kwargs):
    """`generate_batch` with `ContinuousBatchingConfig(**cb)`; `kwargs` go to generate_batch."""
    return model.generate_batch(
        prompts, config, ContinuousBatchingConfig(**(cb or {})), progress_bar=False, **kwargs
    )


# -- the vectorized warpers equal transformers' processors row by row ------------------------------
@pytest.mark.parametrize(
    ("name", "values", "make"),
    [
        ("temperature", [0.5, 1.0, 2.0, 0.7], lambda v: lp.TemperatureLogitsWarper(v)),
        ("top_k", [1, 0, 5, 40], lambda v: lp.TopKLogitsWarper(v) if v else None),
        ("top_p", [0.1, 1.0, 0.5, 0.95], lambda v: lp.TopPLogitsWarper(v) if v < 1 else None),
        ("min_p", [0.0, 0.05, 0.5, 0.2], lambda v: lp.MinPLogitsWarper(v)),
    ],
)
def test_vector_warper_equals_transformers_per_row(name, values, make) -> None:
    torch.manual_seed(0)
    scores = torch.randn(len(values), 50) * 3
    ours = getattr(warpers, name)(scores.clone(), values)
    for i, value in enumerate(values):
        processor = make(value)
        expected = scores[i : i + 1] if processor is None else processor(None, scores[i : i + 1].clone())
        torch.testing.assert_close(ours[i : i + 1], expected, rtol=0, atol=0)


def test_vector_repetition_penalty_equals_transformers_per_row() -> None:
    torch.manual_seed(0)
    scores = torch.randn(3, 30)
    histories = [[1, 2, 3, 3], [4], [5, 6, 7, 8, 9, 29]]
    penalties = [1.3, 1.0, 0.7]
    seen = torch.zeros(3, 30, dtype=torch.bool)
    for i, history in enumerate(histories):
        seen[i, history] = True
    ours = warpers.repetition_penalty(scores.clone(), seen, penalties)
    for i, (history, penalty) in enumerate(zip(histories, penalties, strict=True)):
        expected = lp.RepetitionPenaltyLogitsProcessor(penalty)(
            torch.tensor([history]), scores[i : i + 1].clone()
        )
        torch.testing.assert_close(ours[i : i + 1], expected, rtol=0, atol=0)


# -- per-request parameters -------------------------------------------------------------------------
def test_per_request_parameter_needs_the_flag(model) -> None:
    with pytest.raises(ValueError, match="per_request_processors=True"):
        _run(model, [[5, 6, 7]], temperature=0.5)
    manager = model.init_continuous_batching(SAMPLED)
    with pytest.raises(ValueError, match="per_request_processors=True"):
        manager.add_request([5, 6, 7], top_k=3)
    manager.destroy()


def test_per_request_parameter_needs_its_processor(model) -> None:
    """The documents' rule: the processor exists only when the GenerationConfig value is non-default."""
    config = GenerationConfig(max_new_tokens=2, do_sample=True, temperature=1.0, top_k=0, eos_token_id=None)
    for name, value in (("temperature", 0.5), ("top_k", 5), ("repetition_penalty", 1.2)):
        with pytest.raises(ValueError, match=f"GenerationConfig.{name}"):
            _run(model, [[5, 6, 7]], config, {"per_request_processors": True}, **{name: value})
    greedy = GenerationConfig(max_new_tokens=2, do_sample=False, temperature=0.5, eos_token_id=None)
    with pytest.raises(ValueError, match="do_sample=False"):
        _run(model, [[5, 6, 7]], greedy, {"per_request_processors": True}, temperature=0.5)


@pytest.mark.parametrize(
    ("name", "value"),
    [("temperature", 0), ("temperature", "hot"), ("top_k", -1), ("top_k", 2.5), ("top_p", 0.0), ("top_p", 1.5),
     ("min_p", -0.1), ("repetition_penalty", 0), ("seed", "x"), ("stop_strings", [""]), ("top_logprobs", -2),
     ("prompt_logprobs", 1)],
)  # fmt: skip
def test_bad_per_request_values_are_refused_at_submission(model, name, value) -> None:
    config = GenerationConfig(max_new_tokens=2, do_sample=True, temperature=0.7, top_k=5, top_p=0.9, min_p=0.1,
                              repetition_penalty=1.1, eos_token_id=None)  # fmt: skip
    with pytest.raises(ValueError, match=f"inputs\\[0\\].*{name}"):
        _run(model, [[5, 6, 7]], config, {"per_request_processors": True}, **{name: value})


def test_unknown_per_request_parameter_is_refused(model) -> None:
    cb = ContinuousBatchingConfig(per_request_processors=True)
    manager = model.init_continuous_batching(SAMPLED, cb)
    with pytest.raises(ValueError, match="unknown per-request parameter"):
        manager.add_request([5, 6, 7], temprature=0.5)
    manager.destroy()


def test_per_request_params_apply_independently_in_one_batch(model) -> None:
    """Each request's first token logprob is that of `generate()` with the request's own config."""
    prompt = [5, 17, 33, 9]
    settings = [
        {"temperature": 0.5, "top_k": 5},
        {"temperature": 1, "top_k": 0, "top_p": 0.6},  # neutral values (int temperature) are accepted
        {"top_p": 0.3, "min_p": 0.2},
        {"repetition_penalty": 1.0},
    ]
    config = GenerationConfig(max_new_tokens=1, do_sample=True, temperature=0.9, top_k=20, top_p=0.95, min_p=0.05,
                              repetition_penalty=1.3, eos_token_id=None)  # fmt: skip
    cb = ContinuousBatchingConfig(per_request_processors=True, return_logprobs=True, top_logprobs=3, seed=1)
    with model.continuous_batching_context_manager(config, continuous_batching_config=cb) as manager:
        ids = [manager.add_request(prompt, **setting) for setting in settings]
        results = {r.request_id: r for r in (manager.get_result(timeout=TIMEOUT) for _ in ids)}
    for request_id, setting in zip(ids, settings, strict=True):
        own = GenerationConfig(**{**config.to_dict(), **setting})
        out = model.generate(torch.tensor([prompt]), generation_config=own, output_scores=True,
                             return_dict_in_generate=True, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))  # fmt: skip
        expected = out.scores[0].log_softmax(-1)[0]
        result = results[request_id]
        token = result.generated_tokens[0]
        assert result.logprobs[0] == pytest.approx(float(expected[token]), abs=1e-4), setting
        top_values, top_ids = expected.topk(3)
        finite = int(torch.isfinite(top_values).sum())  # the order of -inf alternatives is arbitrary
        assert list(result.top_logprobs[0])[:finite] == top_ids.tolist()[:finite]
        assert list(result.top_logprobs[0].values()) == pytest.approx(top_values.tolist(), abs=1e-4)


@pytest.mark.parametrize(
    "warper",
    [{"typical_p": 0.5}, {"epsilon_cutoff": 0.004}, {"eta_cutoff": 0.003}, {"top_h": 0.4}, {"min_p": 0.3},
     {"temperature": 0.4, "top_k": 7, "top_p": 0.8, "renormalize_logits": True}],
)  # fmt: skip
def test_sampled_logprobs_equal_generate_processed_scores(model, warper) -> None:
    """First token: its logprob and the top alternatives are those of `generate()`'s processed scores."""
    prompt = [11, 12, 250, 3, 3, 8]
    config = GenerationConfig(max_new_tokens=1, do_sample=True, eos_token_id=None, **{"top_k": 0, **warper})
    outputs = _run(model, [prompt] * 4, config, {"top_logprobs": 4, "seed": 5})
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        scores = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config,
                                output_scores=True, return_dict_in_generate=True).scores[0][0]  # fmt: skip
    expected = scores.float().log_softmax(-1)
    for output in outputs.values():
        token = output.generated_tokens[0]
        assert torch.isfinite(expected[token]), "sampled a token the processed scores exclude"
        assert output.logprobs[0] == pytest.approx(float(expected[token]), abs=1e-4)
        assert list(output.top_logprobs[0].values()) == pytest.approx(
            expected.topk(4).values.tolist(), abs=1e-4
        )


# -- seeds ----------------------------------------------------------------------------------------------
def test_seeded_request_is_batch_invariant(model) -> None:
    """The same seeded request gives the same tokens alone and inside busy batches, however they are
    scheduled, chunked or evicted and recomputed."""
    target = prompts_of_lengths([23], seed=7)[0]
    others = prompts_of_lengths([5, 40, 12, 31, 8, 19], seed=8)
    config = GenerationConfig(max_new_tokens=12, do_sample=True, temperature=1.5, eos_token_id=None)
    alone = _run(model, [target], config, {"seed": 4, "page_size": 4})["req_0"]
    runs = [
        {"page_size": 4, "max_batch_tokens": 16},
        {"page_size": 16, "max_batch_tokens": 64, "scheduler_type": "prefill_first"},
        {"page_size": 4, "max_batch_tokens": 32, "num_blocks": 20},  # tight: evictions
    ]
    seeds = [*range(len(others)), derive_seed(4, "req_0")]
    target_id = f"req_{len(others)}"
    for settings in runs:
        cb = {"per_request_processors": True, **settings}
        with count_preemptions() as preempted:
            outputs = _run(model, [*others, target], config, cb, seed=seeds)
        assert outputs[target_id].generated_tokens == alone.generated_tokens, settings
        if "num_blocks" in settings:
            assert target_id in preempted, "the tight cache was meant to evict the seeded request"


def test_config_seed_derives_a_seed_per_request_id(model) -> None:
    prompts = [[5, 6, 7]] * 4
    first = _run(model, prompts, cb={"seed": 11})
    again = _run(model, prompts, cb={"seed": 11})
    other = _run(model, prompts, cb={"seed": 12})
    tokens = [o.generated_tokens for o in first.values()]
    assert tokens == [o.generated_tokens for o in again.values()]
    assert tokens != [o.generated_tokens for o in other.values()]
    assert len({tuple(t) for t in tokens}) > 1  # same prompt, different ids: different streams


def test_per_request_seed_reproduces_whatever_the_ids(model) -> None:
    outputs = _run(model, [[5, 6, 7]] * 3, cb={"per_request_processors": True}, seed=[3, 3, 4])
    assert outputs["req_0"].generated_tokens == outputs["req_1"].generated_tokens
    assert outputs["req_0"].generated_tokens != outputs["req_2"].generated_tokens


# -- prompt logprobs ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "settings", [{}, {"max_batch_tokens": 16, "page_size": 4}, {"page_size": 4, "num_blocks": 14}]
)
def test_prompt_logprobs_equal_a_plain_forward(model, settings) -> None:
    prompts = prompts_of_lengths([37, 3, 20, 1], seed=9)
    config = GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=None)
    outputs = _run(model, prompts, config, {"prompt_logprobs": True, **settings})
    model.set_attn_implementation("sdpa")
    try:
        for i, prompt in enumerate(prompts):
            with torch.inference_mode():
                logits = model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
            expected = [None] + [float(logits[p, prompt[p + 1]]) for p in range(len(prompt) - 1)]
            got = outputs[f"req_{i}"].prompt_logprobs
            assert got[0] is None and len(got) == len(prompt)
            assert got[1:] == pytest.approx(expected[1:], abs=1e-4)
    finally:
        model.set_attn_implementation("paged|sdpa")


def test_prompt_logprobs_per_request_only_where_asked(model) -> None:
    config = GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=None)
    outputs = _run(model, [[5, 6, 7], [8, 9]], config, prompt_logprobs=[True, False])
    assert len(outputs["req_0"].prompt_logprobs) == 3
    assert outputs["req_1"].prompt_logprobs is None


# -- stop strings and finish reasons ----------------------------------------------------------------
@pytest.fixture(scope="module")
def text_model():
    tokenizer = build_tiny_tokenizer()
    return build_tiny_model(seed=2, attn_implementation="paged|sdpa", tokenizer=tokenizer), tokenizer


def _ascii_window(text: str, size: int = 2) -> str:
    """A printable substring of the (byte-level, partly undecodable) greedy text."""
    for start in range(len(text) - size + 1):
        window = text[start : start + size]
        if window.isascii() and window.isprintable():
            return window
    raise AssertionError(f"no printable window in {text!r}")


def test_stop_strings_stop_as_generate_does(text_model) -> None:
    model, tokenizer = text_model
    prompts = [tokenizer.encode(t) for t in ("hello there", "abc", "the cat sat")]
    free = GenerationConfig(max_new_tokens=24, do_sample=False, eos_token_id=None)
    plain = _run(model, prompts, free)
    text = tokenizer.decode(plain["req_0"].generated_tokens)
    stop = _ascii_window(text)  # a string the greedy continuation contains
    config = GenerationConfig(
        max_new_tokens=24, do_sample=False, eos_token_id=None, stop_strings=[stop, "zzz"]
    )
    outputs = _run(model, prompts, config, tokenizer=tokenizer)
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([prompt])
        expected = model.generate(
            ids, attention_mask=torch.ones_like(ids), generation_config=config, tokenizer=tokenizer
        )
        output = outputs[f"req_{i}"]
        assert output.generated_tokens == expected[0, len(prompt) :].tolist()
        stopped = len(output.generated_tokens) < 24
        assert output.finish_reason == ("stop" if stopped else "length")
    assert outputs["req_0"].finish_reason == "stop"


def test_stop_strings_per_request_and_without_tokenizer(text_model) -> None:
    model, tokenizer = text_model
    prompt = tokenizer.encode("hello there")
    free = GenerationConfig(max_new_tokens=24, do_sample=False, eos_token_id=None)
    stop = _ascii_window(tokenizer.decode(_run(model, [prompt], free)["req_0"].generated_tokens))
    with pytest.raises(ValueError, match="tokenizer"):
        _run(model, [prompt], free, {"per_request_processors": True}, stop_strings=stop)
    cb = {"per_request_processors": True}
    outputs = _run(model, [prompt, prompt], free, cb, tokenizer=tokenizer, stop_strings=[[stop], None])
    assert outputs["req_0"].finish_reason == "stop" and len(outputs["req_0"].generated_tokens) < 24
    assert outputs["req_1"].finish_reason == "length"
    assert stop in tokenizer.decode(outputs["req_0"].generated_tokens)


def test_finish_reasons(model) -> None:
    prompt = [5, 17, 33]
    config = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=None)
    first = _run(model, [prompt], config)["req_0"].generated_tokens
    # eos may be a list; hitting any of them is "stop"
    stopped = _run(model, [prompt], config, eos_token_id=[299, first[1]])["req_0"]
    assert (stopped.generated_tokens, stopped.finish_reason) == (first[:2], "stop")
    assert _run(model, [prompt], config)["req_0"].finish_reason == "length"
    with model.continuous_batching_context_manager(config) as manager:
        manager.cancel_request(manager.add_request(prompt, request_id="c", max_new_tokens=400))
        cancelled = manager.get_result("c", timeout=TIMEOUT)
    assert (cancelled.status, cancelled.finish_reason) == (RequestStatus.CANCELLED, "cancelled")


@pytest.mark.parametrize("values", [{"temperature": 0.0}, {"top_p": -0.2, "top_k": 0}, {"min_p": -0.5}])
def test_bad_generation_config_values_are_refused(model, values) -> None:
    config = GenerationConfig(max_new_tokens=2, do_sample=True, eos_token_id=None, **values)
    with pytest.raises(ValueError, match="GenerationConfig: invalid"):
        _run(model, [[5, 6, 7]], config)


def test_stop_string_criteria_kept_for_the_sets_used_last(text_model) -> None:
    """A server's clients may send any stop strings: the criteria built for them (vocabulary-sized tables)
    are kept for the `CACHE_SIZE` sets used last, not for every set ever seen (the soak's memory)."""
    from transformers_cb.sampling import stop_strings

    _, tokenizer = text_model
    kept = stop_strings.StopStrings(tokenizer)
    first = kept.criteria(("first",))
    for i in range(stop_strings.CACHE_SIZE + 5):
        kept.criteria((f"s{i}",))
        assert kept.criteria(("first",)) is first  # used again: kept
    assert len(kept._criteria) == stop_strings.CACHE_SIZE
    assert ("s0",) not in kept._criteria  # the least recently used went first
