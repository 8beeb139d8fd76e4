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


def test_greedy_on_bf16_logits_picks_what_float32_picks() -> None:
    # The runner hands the sampler the model's bf16 logits (no float32 copy a step): the hot path's
    # tokens, ties included, and a processed row's, are those of the widened logits.
    from types import SimpleNamespace

    from transformers_cb.sampling.sampler import Sampler

    generator = torch.Generator().manual_seed(1)
    logits = (torch.randint(-8, 8, (32, 49152), generator=generator) / 4).bfloat16()
    logits[:, ::11] = logits.max()  # exact ties at the maximum
    requests = [SimpleNamespace(sampling=None, all_token_ids=[1, 2]) for _ in range(32)]
    sampler = Sampler([], do_sample=False, device=torch.device("cpu"))
    tokens = sampler.sample(logits, requests).tokens
    assert tokens == logits.float().argmax(dim=-1).tolist()
