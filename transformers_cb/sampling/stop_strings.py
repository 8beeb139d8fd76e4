"""Stop strings, matched as `generate(stop_strings=..., tokenizer=...)` matches them.

transformers' `StopStringCriteria` does the matching (a stop string may span tokens and overhang
the last one); it is built once per distinct set of strings, since building it walks the whole
vocabulary, and is called with the request's own tokens (prompt + generated, as in `generate()`). The
built ones are kept for the `CACHE_SIZE` sets used last: a server's clients may send any strings, and each
criteria holds tables the size of the vocabulary.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch
from transformers import PreTrainedTokenizerBase
from transformers.generation.stopping_criteria import StopStringCriteria

from ..invariants import present

CACHE_SIZE = 32


class StopStrings:
    """Args: tokenizer: the model's tokenizer, or None (then stop strings are refused)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None) -> None:
        self.tokenizer = tokenizer
        self._criteria: OrderedDict[tuple[str, ...], StopStringCriteria] = OrderedDict()

    def check_available(self, strings: Sequence[str], label: str) -> None:
        if strings and self.tokenizer is None:
            raise ValueError(
                f"{label}: stop_strings need a tokenizer: pass tokenizer= to generate_batch / "
                "init_continuous_batching (as generate() takes one)"
            )

    def criteria(self, strings: tuple[str, ...]) -> StopStringCriteria:
        found = self._criteria.get(strings)
        if found is not None:
            self._criteria.move_to_end(strings)
            return found
        found = self._criteria[strings] = StopStringCriteria(
            present(self.tokenizer, "stop strings without a tokenizer (check_available refuses them)"),
            list(strings),
        )
        if len(self._criteria) > CACHE_SIZE:
            self._criteria.popitem(last=False)
        return found


def hits_stop_string(criteria: StopStringCriteria, token_ids: list[int]) -> bool:
    """True when `token_ids` (prompt + generated) ends with one of `criteria`'s stop strings."""
    tail = token_ids[-criteria.maximum_token_len :]
    return bool(criteria(torch.tensor([tail], dtype=torch.long), None)[0])
