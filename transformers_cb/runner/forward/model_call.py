"""One call of the model's forward on a packed step, the same for eager, compiled and graph-captured steps.

The engine's contract with the model is the kwargs of this call: `position_ids`, the 4D no-mask, the
attention metadata, and `logits_to_keep` (the rows that produce a token). Two families of models break a
clause and are adapted here, once, instead of per model:

- decoder layers that do not pass the forward's `**kwargs` down to their attention module (StableLM,
  Nemotron): the step's metadata is also set in `attention.paged.step_metadata` for the forward's
  duration, where the paged glue finds it when the kwarg is missing;
- forwards that ignore `logits_to_keep` and return every position's logits (VideoLLaMA 3, the Qwen
  Omni thinkers): the rows are selected here (`select_rows`, learned by the support check's probe; a
  row count that is neither the kept rows' nor the step's is a broken contract).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ...attention.metadata import AttentionMetadata
from ...attention.paged import METADATA_KWARG, step_metadata
from ...invariants import InvariantError


def call_model(
    forward: Callable[..., Any],
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    keep: torch.Tensor,
    metadata: AttentionMetadata,
    select_rows: bool = False,
    inputs_embeds: torch.Tensor | None = None,
) -> torch.Tensor:
    """The forward's logits at the rows `keep` (indices into the step's tokens), `[len(keep), vocab]`.

    Args:
        select_rows: the model ignores `logits_to_keep` (the probe saw it): its logits cover every token
            of the step, and the rows are selected here even when their count equals the step's.
        inputs_embeds: the step's embeddings with its media rows (runner/media/media_runner.py), given instead of
            `input_ids`.
    """
    tokens_or_embeds = {"input_ids": input_ids} if inputs_embeds is None else {"inputs_embeds": inputs_embeds}
    with step_metadata(metadata):
        output = forward(
            **tokens_or_embeds,
            position_ids=position_ids,
            attention_mask=attention_mask,
            use_cache=False,
            logits_to_keep=keep,
            **{METADATA_KWARG: metadata},
        )
    logits = output.logits[0]
    rows, tokens, kept = logits.shape[0], input_ids.shape[1], keep.numel()
    if select_rows or rows != kept:
        if rows != tokens:
            raise InvariantError(
                f"the model returned logits for {rows} positions: neither the {kept} kept by logits_to_keep "
                f"nor the step's {tokens} tokens"
            )
        logits = logits.index_select(0, keep)
    return logits
