"""Whether an engine can speculate (docs/speculative_decoding.md), decided once when it is built.

Speculation writes KV for draft tokens and takes the rejected ones back by rolling a request's token
count back: that needs every per-request state to be positional (paged KV). What cannot roll back, or
cannot carry several tokens per request and step, refuses speculation with the reason, which
`Engine.build_request` (per request) and the engine's start (a `GenerationConfig` that asks for it) raise
as a `ValueError`. Models with state layers (linear attention, state-space, short convolutions:
docs/state_layers.md) refuse: their recurrent state has absorbed the rejected tokens and cannot be
rolled back to the last accepted one.
"""

from __future__ import annotations

from transformers import PreTrainedModel

from ..distributed.sharding import tp_size_of


def speculation_refusal(model: PreTrainedModel, has_state_layers: bool = False) -> str | None:
    """Why an engine running `model` cannot speculate, or None when it can (`has_state_layers`: the
    model has state layers, engine/state_probe.py)."""
    if has_state_layers:
        return (
            "speculative decoding (prompt_lookup_num_tokens) is not supported for models with state layers "
            "(linear attention, state-space, short convolutions): a recurrent state that has taken in "
            "rejected draft tokens cannot be rolled back"
        )
    if tp_size_of(model) > 1:
        return (
            "speculative decoding (prompt_lookup_num_tokens) is not supported under tensor parallelism "
            "(tp_size > 1): the other ranks replay one token per request and step"
        )
    return None
