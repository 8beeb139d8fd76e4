"""`num_return_sequences`: the sibling requests of one submission.

A request submitted with n sequences carries n - 1 siblings (`Request.siblings`), ids
`f"{request_id}__child#{i}"` as in transformers. With prefix sharing the scheduler forks them
from the request once its prompt is computed (they share its pages, see kv/prefix_cache.py);
without it they run as requests of their own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from transformers import GenerationConfig

from ...requests import Request
from ...sampling.params import derive_seed
from ...sampling.request_state import SamplingSetup


def num_return_sequences_of(value: int | None, config: GenerationConfig, label: str) -> int:
    """The submission's value, else the generation config's, else 1. Raises `ValueError` naming `label`."""
    if value is None:
        value = config.num_return_sequences
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{label}: num_return_sequences must be an int >= 1, got {value!r}")
    return value


def add_siblings(
    parent: Request, count: int, sampling: SamplingSetup, params: Mapping[str, Any], label: str
) -> None:
    """Give `parent` its `count - 1` siblings, each with its own id and random stream (`params`: the
    submission's sampling parameters, a seed derived per sibling)."""
    for index in range(count - 1):
        request_id = f"{parent.request_id}__child#{index}"
        kwargs = dict(params)
        if kwargs.get("seed") is not None:  # reproducible, and not the parent's draws again
            kwargs["seed"] = derive_seed(kwargs["seed"], request_id)
        child = Request(
            request_id=request_id,
            prompt_ids=list(parent.prompt_ids),
            max_new_tokens=parent.max_new_tokens,
            eos_token_ids=parent.eos_token_ids,
            streaming=parent.streaming,
            record_timestamps=parent.record_timestamps,
            fork_parent=parent,
            media=parent.media,  # a sibling that prefills on its own encodes them again
        )
        sampling.attach(child, kwargs, label)
        parent.siblings.append(child)
    parent.fork_children = list(parent.siblings)
