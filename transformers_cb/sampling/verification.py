"""Verifying draft tokens (speculative decoding): which of a request's draft tokens the target model
accepts, and the token it adds after them.

A speculating request's step yields `1 + k` rows of logits: row `j` predicts the token after its known
tokens and the draft's first `j`. Each row is processed exactly as if the tokens had come one at a time
(`Sampler.scores` on a `DraftView`: the request with the draft's first `j` tokens appended, so every
processor, penalty, guided mask and `min_tokens` sees that history), in passes by depth, so that the
per-request caches (`RequestSampling`) only ever grow within a step; they are rolled back to the
accepted tokens afterwards (`RequestSampling.rollback`).

- greedy: the draft is accepted while it equals the argmax; the argmax after the accepted prefix follows
  (the correction, or the bonus token when all were accepted), so the output is plain greedy's;
- sampling: standard speculative rejection sampling with a deterministic draft (q is one-hot, as for
  prompt lookup): draft token `d` is accepted with probability `p(d)`; on rejection the token is drawn
  from `max(p - q, 0)` normalized, i.e. `p` without `d`; after a fully accepted draft the bonus token is
  drawn from the last row. Each emitted token is then distributed exactly as `p` (docs/speculative_decoding.md).

Guided requests: a draft token the grammar forbids ends the draft before verification (the target gives
it probability 0). Logprobs and top logprobs are the target's, row by row, as without speculation.
"""

from __future__ import annotations

import torch

from ..requests import Request
from .request_state import RequestSampling, sampling_state
from .sampled_token import SampledToken
from .sampler import Sampler, best_tokens


class DraftView:
    """`request` as the sampler sees it at draft depth `len(extra)`: its tokens followed by `extra`."""

    __slots__ = (
        "all_token_ids",
        "eos_token_ids",
        "generated_ids",
        "max_new_tokens",
        "num_prompt_tokens",
        "prompt_ids",
        "request_id",
        "sampling",
    )

    def __init__(self, request: Request, extra: list[int]) -> None:
        self.request_id = request.request_id
        self.sampling = request.sampling
        self.prompt_ids = request.prompt_ids
        self.num_prompt_tokens = request.num_prompt_tokens
        self.max_new_tokens = request.max_new_tokens
        self.eos_token_ids = request.eos_token_ids
        self.all_token_ids = [*request.all_token_ids, *extra] if extra else request.all_token_ids
        self.generated_ids = [*request.generated_ids, *extra] if extra else request.generated_ids


def verify(
    sampler: Sampler, logits: torch.Tensor, requests: list[Request], drafts: list[list[int]]
) -> list[list[SampledToken]]:
    """The tokens each request appends: `logits` has `1 + len(drafts[i])` rows per request, in order.

    Returns, per request, its accepted draft tokens and then the target's own token (at least one)."""
    offsets, row = [], 0
    for draft in drafts:
        offsets.append(row)
        row += 1 + len(draft)
    states = [sampling_state(request) for request in requests]
    if all(state is None for state in states):  # plain greedy: one argmax over every row
        best = best_tokens(logits).tolist()
        return [
            [SampledToken(t) for t in _greedy_run(best[o : o + 1 + len(d)], d)]
            for o, d in zip(offsets, drafts, strict=True)
        ]
    drafts = [_allowed_draft(request, draft) for request, draft in zip(requests, drafts, strict=True)]
    scores = _processed_scores(sampler, logits, requests, drafts, offsets)
    runs = []
    for request, state, draft, offset in zip(requests, states, drafts, offsets, strict=True):
        rows = scores[offset : offset + 1 + len(draft)]
        if state is not None and state.params.do_sample:
            tokens = _sampled_run(rows, draft, state)
        else:
            tokens = _greedy_run(best_tokens(rows).tolist(), draft)
        runs.append(_with_logprobs(rows, tokens, state))
        if state is not None and draft:
            accepted = len(tokens) - 1
            state.rollback(request.num_tokens + accepted, len(request.generated_ids) + accepted)
    return runs


def _allowed_draft(request: Request, draft: list[int]) -> list[int]:
    """The draft up to the first token the request's grammar forbids (all of it when unguided)."""
    state = sampling_state(request)
    if not draft or state is None or state.grammar is None:
        return draft
    return draft[: state.grammar.allowed_prefix(request.generated_ids, draft)]


def _processed_scores(
    sampler: Sampler,
    logits: torch.Tensor,
    requests: list[Request],
    drafts: list[list[int]],
    offsets: list[int],
) -> torch.Tensor:
    """Every used row processed with its own history, one pass per draft depth (rows of a cut draft,
    past its new end, stay unprocessed and unused)."""
    scores = logits.clone()
    for depth in range(1 + max(len(draft) for draft in drafts)):
        members = [i for i, draft in enumerate(drafts) if len(draft) >= depth]
        rows = torch.tensor([offsets[i] + depth for i in members], dtype=torch.long, device=logits.device)
        views = [DraftView(requests[i], drafts[i][:depth]) for i in members]
        scores[rows] = sampler.scores(logits.index_select(0, rows), views)
    return scores


def _greedy_run(best: list[int], draft: list[int]) -> list[int]:
    """The draft while it matches the argmax of its rows, then the argmax after it."""
    accepted = 0
    while accepted < len(draft) and draft[accepted] == best[accepted]:
        accepted += 1
    return best[: accepted + 1]


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from `probs` `[vocab]`: the sampler's exponential race (argmax of p / E, E ~ Exp(1))."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    return int((probs / noise).argmax())


def _sampled_run(rows: torch.Tensor, draft: list[int], state: RequestSampling) -> list[int]:
    """Rejection sampling of a one-hot draft: accept `d` with probability p(d), else draw from p without d."""
    probs = rows.softmax(dim=-1)
    generator = state.generator
    tokens: list[int] = []
    for depth, token in enumerate(draft):
        p = float(probs[depth, token])
        u = float(torch.rand((), generator=generator, device=probs.device))
        if u < p:
            tokens.append(token)
            continue
        residual = probs[depth].clone()
        residual[token] = 0.0
        tokens.append(_draw(residual, generator))
        return tokens
    tokens.append(_draw(probs[len(draft)], generator))
    return tokens


def _with_logprobs(
    rows: torch.Tensor, tokens: list[int], state: RequestSampling | None
) -> list[SampledToken]:
    """The tokens with the target's logprob (and top logprobs) at their rows, when the request asks."""
    if state is None or not state.params.return_logprobs:
        return [SampledToken(token) for token in tokens]
    logprobs = rows[: len(tokens)].log_softmax(dim=-1)
    index = torch.tensor(tokens, dtype=torch.long, device=rows.device)[:, None]
    chosen = logprobs.gather(1, index).squeeze(1).tolist()
    k = min(state.params.top_logprobs, logprobs.shape[-1])
    if not k:
        return [SampledToken(t, lp) for t, lp in zip(tokens, chosen, strict=True)]
    top = logprobs.topk(k, dim=-1)
    values, indices = top.values.tolist(), top.indices.tolist()
    return [
        SampledToken(t, lp, dict(zip(indices[j], values[j], strict=True)))
        for j, (t, lp) in enumerate(zip(tokens, chosen, strict=True))
    ]
