"""The greedy reference: plain `model.generate()` on one prompt alone."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel


@torch.inference_mode()
def greedy_reference(
    model: PreTrainedModel,
    prompt: list[int],
    max_new_tokens: int,
    eos_token_id: int | list[int] | None = None,
) -> list[int]:
    """Greedy tokens of plain `model.generate()` on `prompt` alone (eos included when hit)."""
    input_ids = torch.tensor([prompt], dtype=torch.long, device=model.device)
    kwargs = {}
    if eos_token_id is not None:
        kwargs["eos_token_id"] = eos_token_id
    output = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
        **kwargs,
    )
    return output[0, len(prompt) :].tolist()
