"""`SampledToken`: what a step sampled for one request, from the runner to the engine (and, under
tensor parallelism, from rank 0 to the other ranks). Plain data, torch-free."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SampledToken:
    """`logprob`: the token's log-probability when the request asks for logprobs, else None;
    `top_logprobs`: its best alternatives (token id -> logprob) when it asks for them, else None."""

    token_id: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None
