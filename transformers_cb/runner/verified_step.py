"""A step with speculating requests: its sampling entries' logits rows verified (sampling/verification.py)
and split into what the scheduler applies, the first token of each sampling entry and, per
speculating request, the tokens that follow it."""

from __future__ import annotations

import torch

from ..sampling.sampled_token import SampledToken
from ..sampling.sampler import Sampler
from ..sampling.verification import verify
from ..scheduler.plan import ScheduledRequest, StepPlan


def verified_tokens(
    sampler: Sampler, logits: torch.Tensor, sampling_entries: list[ScheduledRequest], batch: StepPlan
) -> tuple[list[SampledToken], dict[str, list[SampledToken]]]:
    """(`sampled`: the first token of each sampling entry in `batch.entries` order, `continuations`:
    request id -> the further tokens of a speculating request). `logits` holds `1 + len(entry.draft)`
    rows per entry of `sampling_entries`, in that order."""
    runs = verify(
        sampler,
        logits,
        [entry.request for entry in sampling_entries],
        [entry.draft for entry in sampling_entries],
    )
    by_entry = {id(entry): run for entry, run in zip(sampling_entries, runs, strict=True)}
    sampled, continuations = [], {}
    for entry in batch.entries:
        if not entry.samples:
            continue
        run = by_entry[id(entry)]
        sampled.append(run[0])
        if entry.draft:
            continuations[entry.request.request_id] = run[1:]
    return sampled, continuations
