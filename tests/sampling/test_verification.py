"""Verifying draft tokens (sampling/verification.py): greedy keeps the argmax chain, rejection sampling
keeps the target distribution exactly (chi-square goodness of fit at fixed seeds), logprobs are the
target's, and the per-request caches forget the rejected draft tokens."""

from __future__ import annotations

from collections import Counter

import torch

from tests.sampling.test_distributions import chi_square, chi_square_critical
from transformers_cb.requests import Request
from transformers_cb.sampling.params import SamplingParams
from transformers_cb.sampling.request_state import RequestSampling
from transformers_cb.sampling.sampler import Sampler
from transformers_cb.sampling.verification import verify

CPU = torch.device("cpu")
VOCAB = 6


def _request(state: RequestSampling | None = None) -> Request:
    request = Request("r", [1, 2, 3], 50)
    request.append_token(4)
    request.sampling = state
    return request


def test_greedy_accepts_the_matching_prefix_then_the_argmax() -> None:
    logits = torch.full((4, VOCAB), -1.0)
    for row, best in enumerate([2, 5, 1, 3]):
        logits[row, best] = 1.0
    sampler = Sampler([], False, CPU)
    runs = verify(sampler, logits, [_request()], [[2, 5, 0]])
    assert [t.token_id for t in runs[0]] == [2, 5, 1]  # third draft token rejected: the target's 1
    runs = verify(sampler, logits, [_request()], [[2, 5, 1]])
    assert [t.token_id for t in runs[0]] == [2, 5, 1, 3]  # all accepted, plus the bonus token
    runs = verify(sampler, logits[:1], [_request()], [[]])
    assert [t.token_id for t in runs[0]] == [2]


def test_logprobs_are_the_targets_at_each_row() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB)
    best = logits.argmax(dim=-1).tolist()
    state = RequestSampling(SamplingParams(return_logprobs=True, top_logprobs=2), [])
    (run,) = verify(Sampler([], False, CPU), logits.clone(), [_request(state)], [best[:2]])
    assert [t.token_id for t in run] == best
    expected = logits.log_softmax(dim=-1)
    for row, token in enumerate(run):
        assert abs(token.logprob - float(expected[row, token.token_id])) < 1e-6
        assert token.top_logprobs is not None and len(token.top_logprobs) == 2


def test_rejection_sampling_keeps_the_target_distribution() -> None:
    """First token, and second token after an accepted first, drawn with a draft are distributed as the
    target's rows: the draft token is accepted with p(d), else p without d is drawn."""
    torch.manual_seed(1)
    logits = torch.randn(3, VOCAB) * 1.5
    probs = logits.softmax(dim=-1)
    draft = [int(probs[0].argsort()[-2]), int(probs[1].argmax())]  # a likely but not the likeliest token
    generator = torch.Generator().manual_seed(7)
    state = RequestSampling(SamplingParams(do_sample=True), [], generator=generator)
    sampler = Sampler([], True, CPU)
    first, second = Counter(), Counter()
    draws = 6000
    for _ in range(draws):
        (run,) = verify(sampler, logits.clone(), [_request(state)], [list(draft)])
        first[run[0].token_id] += 1
        if run[0].token_id == draft[0]:
            second[run[1].token_id] += 1
    stat, dof = chi_square(first, probs[0], draws)
    assert stat < chi_square_critical(max(dof, 3)), (stat, dof, first)
    count = sum(second.values())
    stat, dof = chi_square(second, probs[1], count)
    assert stat < chi_square_critical(max(dof, 3)), (stat, dof, second)


def test_caches_forget_rejected_draft_tokens() -> None:
    state = RequestSampling(SamplingParams(), [])
    request = _request(state)
    state.history(request.all_token_ids + [5, 5], 60, CPU)
    state.seen(request.all_token_ids + [5, 5], VOCAB, CPU)
    state.generated_counts(request.generated_ids + [5, 5], VOCAB, CPU)
    state.rollback(request.num_tokens, len(request.generated_ids))  # both draft tokens rejected
    assert state.history(request.all_token_ids + [0], 60, CPU)[0].tolist() == [1, 2, 3, 4, 0]
    assert state.seen(request.all_token_ids, VOCAB, CPU).tolist() == [False, True, True, True, True, False]
    assert state.generated_counts(request.generated_ids, VOCAB, CPU).tolist() == [0, 0, 0, 0, 1, 0]
