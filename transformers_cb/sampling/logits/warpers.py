"""The processors whose value may differ per request, applied to all rows of a step at once.

Each function takes `scores` `[S, vocab]` and one value per row and computes what
transformers' processor of the same name computes for a batch of one. When every row has the
same value they take transformers' scalar form, so the floating-point result is bit-identical
to `generate()`'s (a per-row tensor divisor can round differently from a Python scalar one).
"""

from __future__ import annotations

from typing import TypeVar

import torch

_Number = TypeVar("_Number", float, int)

FILTER_VALUE = -float("inf")


def _uniform(values: list[_Number]) -> _Number | None:
    first = values[0]
    return first if all(v == first for v in values) else None


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device)[:, None]  # [S, 1]


def repetition_penalty(scores: torch.Tensor, seen: torch.Tensor, penalties: list[float]) -> torch.Tensor:
    """Args: `seen` `[S, vocab]` bool, True for tokens in the row's prompt + generated tokens."""
    penalty: float | torch.Tensor | None = _uniform(penalties)
    if penalty is None:
        penalty = _column(penalties, scores)
    penalized = torch.where(scores < 0, scores * penalty, scores / penalty)
    return torch.where(seen, penalized, scores)


def temperature(scores: torch.Tensor, temperatures: list[float]) -> torch.Tensor:
    value = _uniform(temperatures)
    if value is not None:
        return scores if value == 1.0 else scores / value
    return scores / _column(temperatures, scores)


def top_k(scores: torch.Tensor, ks: list[int]) -> torch.Tensor:
    """k = 0 leaves a row unchanged."""
    vocab = scores.shape[-1]
    ks = [vocab if k == 0 else min(k, vocab) for k in ks]
    value = _uniform(ks)
    if value is not None:
        if value >= vocab:
            return scores
        threshold = torch.topk(scores, value)[0][..., -1, None]
    else:
        ordered = torch.sort(scores, dim=-1, descending=True)[0]
        index = torch.tensor(ks, dtype=torch.int64, device=scores.device)[:, None] - 1
        threshold = ordered.gather(-1, index)
    return scores.masked_fill(scores < threshold, FILTER_VALUE)


def top_p(scores: torch.Tensor, ps: list[float]) -> torch.Tensor:
    """p = 1 leaves a row unchanged."""
    if all(p >= 1.0 for p in ps):
        return scores
    sorted_logits, sorted_indices = torch.sort(scores, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    value = _uniform(ps)
    if value is not None:
        remove = cumulative <= (1 - value)
    else:
        remove = (cumulative <= _column([1 - p for p in ps], cumulative)) & _column(
            [p < 1.0 for p in ps], cumulative
        ).bool()
    remove[..., -1:] = False  # min_tokens_to_keep = 1
    remove = remove.scatter(1, sorted_indices, remove)
    return scores.masked_fill(remove, FILTER_VALUE)


def min_p(scores: torch.Tensor, values: list[float]) -> torch.Tensor:
    """min_p = 0 leaves a row unchanged."""
    probs = torch.softmax(scores, dim=-1)
    top = probs.amax(dim=-1, keepdim=True)
    value = _uniform(values)
    scaled = value * top if value is not None else _column(values, probs) * top
    remove = probs < scaled
    remove.scatter_(-1, torch.topk(probs, 1, dim=-1).indices, False)
    return scores.masked_fill(remove, FILTER_VALUE)
