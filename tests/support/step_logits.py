"""Comparing two greedy runs step by step: the same tokens and every step's logits bit for bit (the direct
layer and direct model steps against the forwards they stand in for)."""

from __future__ import annotations

import torch

Run = tuple[list[list[int]], list[torch.Tensor], int]  # (tokens, every step's logits, steps or calls taken)


def assert_same_logits(logits: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(logits) == len(want)
    for step, (a, b) in enumerate(zip(logits, want, strict=True)):
        assert torch.equal(a, b), f"step {step}: logits differ by {(a - b).abs().max()}"


def assert_same_runs(run: Run, reference: Run) -> int:
    """`run` (the path under test taken) against `reference` (never taken); returns how often `run` took it."""
    tokens, logits, taken = run
    tokens_off, logits_off, taken_off = reference
    assert taken_off == 0
    assert tokens == tokens_off
    assert_same_logits(logits, logits_off)
    return taken
