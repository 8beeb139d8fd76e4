"""OpenAI's per-request processors (logit_bias, min_tokens, presence / frequency penalties) against
their definitions, per-request `do_sample` (greedy rows inside a sampling engine keep no state and take
the argmax), per-request `return_logprobs`, and prompt top logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from transformers import GenerationConfig

from tests.support.models import tiny_llama
from transformers_cb import ContinuousBatchingConfig
from transformers_cb.sampling.logits import openai
from transformers_cb.sampling.params import SamplingParams
from transformers_cb.sampling.request_state import RequestSampling, SamplingSetup


def _sampling_engine(**overrides) -> GenerationConfig:
    """A config that creates every vectorized processor (values requests override)."""
    values = {"do_sample": True, "temperature": 0.5, "top_k": 20, "top_p": 0.9, "min_p": 0.0,
              "repetition_penalty": 1.3, "eos_token_id": None}  # fmt: skip
    return GenerationConfig(**{**values, **overrides})


SAMPLING_ENGINE = _sampling_engine()
NEUTRAL = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0}


@dataclass
class _Request:
    all_token_ids: list[int]
    num_prompt_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    request_id: str = "r"
    prompt_ids: list[int] = field(default_factory=list)
    max_new_tokens: int = 4
    sampling: RequestSampling | None = None


def _state(**params) -> RequestSampling:
    return RequestSampling(params=SamplingParams(**params), row_processors=[])


def test_openai_processors_follow_their_definitions() -> None:
    torch.manual_seed(0)
    scores = torch.randn(4, 12)
    requests = [
        _Request([1, 2, 3, 5, 5, 7], num_prompt_tokens=3),  # completion 5, 5, 7
        _Request([5, 5, 6], num_prompt_tokens=3),  # nothing generated: the prompt's 5s do not count
        _Request([1, 9], num_prompt_tokens=1, eos_token_ids=frozenset({4, 11})),
        _Request([1, 2], num_prompt_tokens=1),
    ]
    states = [
        _state(presence_penalty=0.5, frequency_penalty=0.25),
        _state(presence_penalty=1.5),
        _state(min_tokens=3, logit_bias=((2, 5.0), (8, -100.0))),
        None,  # no state: untouched
    ]
    out = openai.apply(scores.clone(), requests, states)
    expected = scores.clone()
    counts = torch.bincount(torch.tensor([5, 5, 7]), minlength=12).float()
    expected[0] -= counts * 0.25 + (counts > 0).float() * 0.5
    expected[2, 2] += 5.0
    expected[2, 8] -= 100.0
    expected[2, [4, 11]] = -float("inf")  # 1 token generated < min_tokens=3
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    # Once min_tokens are out, eos is allowed again.
    requests[2].all_token_ids = [1, 9, 9, 9]
    assert torch.isfinite(openai.apply(scores.clone(), requests, states)[2, [4, 11]]).all()


def test_a_greedy_request_keeps_no_state_in_a_sampling_engine() -> None:
    setup = SamplingSetup(SAMPLING_ENGINE, torch.device("cpu"), per_request_processors=True)
    greedy = _Request([1, 2, 3], 3, prompt_ids=[1, 2, 3])
    setup.attach(greedy, {"do_sample": False, "seed": 4, **NEUTRAL})
    assert greedy.sampling is None  # the argmax path, as in a greedy engine
    for kwargs in ({"do_sample": False, "presence_penalty": 0.1}, {"do_sample": False, "return_logprobs": True},
                   {**NEUTRAL}):  # fmt: skip
        other = _Request([1, 2, 3], 3, prompt_ids=[1, 2, 3])
        setup.attach(other, kwargs)
        assert other.sampling is not None, kwargs
    warm = _Request([1, 2, 3], 3, prompt_ids=[1, 2, 3])
    setup.attach(warm, {"do_sample": False, "temperature": 0.3, "repetition_penalty": 1.0})
    assert warm.sampling is None  # greedy: the warpers are not built, as in generate(do_sample=False)


@pytest.fixture(scope="module")
def model():
    return tiny_llama("paged|sdpa", seed=5)


def test_greedy_rows_equal_a_greedy_engine_while_others_sample(model) -> None:
    prompts = [[5, 6, 7, 8], [9, 10, 11], [5, 6, 7, 8]]
    cb = ContinuousBatchingConfig(per_request_processors=True)
    greedy = GenerationConfig(do_sample=False, eos_token_id=None, max_new_tokens=8)
    reference = model.generate_batch([prompts[0]], greedy, progress_bar=False)["req_0"].generated_tokens
    config = _sampling_engine(max_new_tokens=8)
    outputs = model.generate_batch(
        prompts, config, cb, progress_bar=False, do_sample=[False, True, True], seed=[None, 1, 2],
        return_logprobs=[True, False, False], **{k: [v] * 3 for k, v in NEUTRAL.items()},
    )  # fmt: skip
    assert outputs["req_0"].generated_tokens == reference
    assert outputs["req_0"].logprobs is not None and outputs["req_1"].logprobs is None
    assert outputs["req_2"].generated_tokens != reference  # it sampled


def test_prompt_top_logprobs_are_the_raw_distributions_best(model) -> None:
    prompt = [5, 17, 33, 9, 12]
    config = GenerationConfig(do_sample=False, eos_token_id=None, max_new_tokens=1)
    out = model.generate_batch([prompt], config, progress_bar=False, prompt_logprobs=True, top_logprobs=3)[
        "req_0"
    ]
    assert out.prompt_top_logprobs[0] is None and len(out.prompt_top_logprobs) == len(prompt)
    plain = tiny_llama("sdpa", seed=5)
    with torch.no_grad():
        logprobs = plain(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    for p in range(1, len(prompt)):
        best = logprobs[p - 1].topk(3)
        got = out.prompt_top_logprobs[p]
        assert list(got) == best.indices.tolist()
        assert list(got.values()) == pytest.approx(best.values.tolist(), abs=1e-4)
        assert out.prompt_logprobs[p] == pytest.approx(logprobs[p - 1, prompt[p]].item(), abs=1e-4)
