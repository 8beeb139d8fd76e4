"""Choosing the paged backend for a model, and switching to it only for the run."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from transformers import PreTrainedModel

from . import PAGED_BACKENDS

logger = logging.getLogger(__name__)

_PAGED_FOR_PLAIN = {None: "paged|sdpa", "sdpa": "paged|sdpa", "eager": "paged|eager"}


def paged_implementation_for(current: str | None) -> str:
    """The paged backend that runs a model currently set to `current`."""
    if current in PAGED_BACKENDS:
        return current
    if current in _PAGED_FOR_PLAIN:
        return _PAGED_FOR_PLAIN[current]
    if current is not None and "flash" in current:
        raise NotImplementedError(
            f"attn_implementation={current!r}: the paged flash-attention backend is not implemented yet; "
            "load the model with 'sdpa' or 'paged|sdpa'"
        )
    logger.warning(
        "attn_implementation=%r has no paged counterpart; continuous batching runs 'paged|sdpa'", current
    )
    return "paged|sdpa"


@contextmanager
def paged_attention(model: PreTrainedModel) -> Iterator[str]:
    """Switch `model` to its paged backend for the block, then restore what the user chose."""
    current = model.config._attn_implementation
    target = paged_implementation_for(current)
    if target != current:
        model.set_attn_implementation(target)
    try:
        yield target
    finally:
        if target != current and model.config._attn_implementation == target:
            model.set_attn_implementation(current if current is not None else "sdpa")
