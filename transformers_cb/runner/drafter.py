"""The draft model (`assistant_model`) on its own paged cache: the forwards and block-table rows the
draft model's planner decides (scheduler/speculation/shadow_planner.py, `ShadowPlanner`), executed.

It decides nothing: the planner owns the shadows, their pages and every step's entries; this runs each
step it is handed (packed over the assistant's `PagedKVCache` and block tables, greedy: the argmax row
and its probability), gives rows back, and forgets the columns of rolled-back draft tokens, as the
target's runner does from its plan (`StepPlan.taken_back`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from transformers import PreTrainedModel

from ..attention.selection import paged_backend
from ..requests import Request
from ..scheduler.step_plan import ScheduledRequest, StepPlan
from .forward.model_call import call_model
from .packing import BatchPacker


class Drafter:
    """Args:
    model: the assistant (a causal LM with the target's vocabulary, full-attention or sliding KV only).
    packer: packs its steps over its own `PagedKVCache` and block tables.
    attn_implementation: the paged backend the assistant runs under.
    select_rows: the assistant ignores `logits_to_keep` (runner/forward/model_call.py).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        packer: BatchPacker,
        attn_implementation: str,
        select_rows: bool = False,
    ) -> None:
        self.model = model
        self.packer = packer
        self.attn_implementation = attn_implementation
        self.select_rows = select_rows
        self._no_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=packer.device)

    @contextmanager
    def session(self) -> Iterator[None]:
        """The assistant under its paged backend for the block (what `attention` otherwise does per draft)."""
        with paged_backend(self.model, self.attn_implementation):
            yield

    @contextmanager
    def attention(self) -> Iterator[None]:
        """The assistant's paged backend, switched here only when the caller's `session` did not."""
        if self.model.config._attn_implementation == self.attn_implementation:
            yield
            return
        with paged_backend(self.model, self.attn_implementation):
            yield

    def release(self, shadow: Request) -> None:
        """`shadow`'s block-table rows go back (its pages were freed)."""
        self.packer.release_request(shadow)

    def take_back(self, shadow: Request, end_pages: Sequence[int]) -> None:
        """`shadow` gave the pages of rejected draft tokens back: its rows forget those columns."""
        self.packer.take_back(shadow, end_pages)

    @torch.inference_mode()
    def forward(self, entries: list[ScheduledRequest]) -> dict[str, tuple[int, float]]:
        """One assistant forward over `entries`; request id -> (argmax token, its probability) of each
        entry that reaches its shadow's last token."""
        step = self.packer.pack(StepPlan(entries=entries))
        keep = step.logits_indices
        if keep.numel() == 0:  # catch-up chunks only: keep one row so that shapes stay valid
            keep = torch.zeros(1, dtype=torch.int64, device=self.packer.device)
        logits = call_model(
            self.model.forward,
            step.input_ids,
            step.position_ids,
            self._no_mask,
            keep,
            step.metadata,
            self.select_rows,
        )
        if not step.sampling_entries:
            return {}
        probabilities, tokens = logits[: len(step.sampling_entries)].float().softmax(-1).max(-1)
        return {
            entry.request.request_id: (token, probability)
            for entry, token, probability in zip(
                step.sampling_entries, tokens.tolist(), probabilities.tolist(), strict=True
            )
        }

    def check_rows(self, shadows: list[Request]) -> None:
        """The block-table rows agree with `shadows`' pages (raises `InvariantError`)."""
        for tables in self.packer.block_tables:
            tables.check_integrity(shadows)
