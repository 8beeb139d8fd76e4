"""The runner: everything that touches the device for one step.

It packs the scheduled batch, runs the transformers model's own forward once
(with the paged attention metadata passed through the attention kwargs),
computes logits only for positions that produce a token, and samples.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from .attention.paged import METADATA_KWARG
from .batch import BatchPacker, PackedStep
from .sampling import Sampler
from .scheduler import ScheduledBatch


class ModelRunner:
    def __init__(
        self, model: PreTrainedModel, packer: BatchPacker, sampler: Sampler, return_logprobs: bool
    ) -> None:
        self.model = model
        self.packer = packer
        self.sampler = sampler
        self.return_logprobs = return_logprobs
        self.device = packer.device
        # A 4D mask makes transformers' mask builders return early: the paged kernels mask by construction.
        self._no_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=self.device)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> list[tuple[int, float | None]]:
        """Run one step; return (token, logprob) for each sampling entry, in `batch.entries` order."""
        step = self.packer.pack(batch)
        logits = self._forward(step)
        tokens, logprobs = self.sampler.sample(logits, self.return_logprobs)
        by_entry = {
            id(entry): (token, None if logprobs is None else logprobs[i])
            for i, (entry, token) in enumerate(zip(step.sampling_entries, tokens, strict=False))
        }
        return [by_entry[id(entry)] for entry in batch.entries if entry.samples]

    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch) -> torch.Tensor:
        """The forward alone, no sampling (a tensor-parallel follower's step; rank 0 samples)."""
        return self._forward(self.packer.pack(batch))

    def _forward(self, step: PackedStep) -> torch.Tensor:
        """Returns float32 logits `[S, vocab]` for the sampled positions."""
        if step.logits_indices.numel() == 0:
            # A step of prefill chunks only: keep one position so shapes stay valid, discard it.
            logits_to_keep = torch.zeros(1, dtype=torch.int64, device=self.device)
        else:
            logits_to_keep = step.logits_indices
        output = self.model(
            input_ids=step.input_ids,
            position_ids=step.position_ids,
            attention_mask=self._no_mask,
            use_cache=False,
            logits_to_keep=logits_to_keep,
            **{METADATA_KWARG: step.metadata},
        )
        logits = output.logits[0].float()  # [S, vocab]
        return logits[: step.logits_indices.numel()]
