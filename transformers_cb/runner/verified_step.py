"""A step with speculating requests: its sampling entries' logits rows verified (sampling/verification.py),
each entry's run of tokens in the plan's order (`StepOutput.sampled`)."""

from __future__ import annotations

import torch

from ..sampling.sampled_token import SampledToken
from ..sampling.sampler import Sampler
from ..sampling.verification import verify
from ..scheduler.step_plan import ScheduledRequest, StepPlan


def verified_tokens(
    sampler: Sampler, logits: torch.Tensor, sampling_entries: list[ScheduledRequest], batch: StepPlan
) -> list[list[SampledToken]]:
    """The tokens of each sampling entry in `batch.entries` order: a speculating entry's accepted draft
    tokens then the target's own, another entry's one token. `logits` holds `1 + len(entry.draft)` rows
    per entry of `sampling_entries` (the packed order), in that order."""
    runs = verify(
        sampler,
        logits,
        [entry.request for entry in sampling_entries],
        [entry.draft for entry in sampling_entries],
    )
    by_entry = {id(entry): run for entry, run in zip(sampling_entries, runs, strict=True)}
    return [by_entry[id(entry)] for entry in batch.entries if entry.samples]
