"""`Sampler` helpers: the greedy choice through `max` equals `argmax`, ties and NaN rows included."""

from __future__ import annotations

import torch

from transformers_cb.sampling.sampler import best_tokens


def test_best_tokens_is_argmax_with_ties_and_nan() -> None:
    generator = torch.Generator().manual_seed(0)
    for n in (7, 4096, 32000):
        scores = torch.randint(0, 4, (16, n), generator=generator).float()  # many ties
        scores[3, 5] = float("nan")
        assert torch.equal(best_tokens(scores), scores.argmax(dim=-1))
        assert torch.equal(best_tokens(scores.bfloat16()), scores.bfloat16().argmax(dim=-1))
