"""Seeded random prompts of token ids in [low, vocab): never the tiny models' bos / eos / pad ids (0, 1, 2)."""

from __future__ import annotations

import random
from collections.abc import Sequence

from tests.support.models import VOCAB_SIZE


def _tokens(rng: random.Random, lengths: Sequence[int], vocab: int, low: int) -> list[list[int]]:
    return [[rng.randrange(low, vocab) for _ in range(length)] for length in lengths]


def prompts_of_lengths(
    lengths: Sequence[int], vocab: int = VOCAB_SIZE, seed: int = 0, low: int = 3
) -> list[list[int]]:
    """Prompts of the given lengths (`vocab` defaults to the unit tests' tiny models')."""
    return _tokens(random.Random(seed), lengths, vocab, low)


def random_prompts(
    count: int, vocab: int, min_len: int = 1, max_len: int = 40, seed: int = 0
) -> list[list[int]]:
    """`count` prompts of random lengths. The lengths depend only on `seed`, `count` and the length range,
    not on `vocab`, so every family gets the same step schedule."""
    rng = random.Random(seed)
    lengths = [rng.randint(min_len, max_len) for _ in range(count)]
    return _tokens(rng, lengths, vocab, 3)
