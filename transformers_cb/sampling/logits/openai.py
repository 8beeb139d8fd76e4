"""OpenAI's per-request logits processors, over all rows of a step at once.

With OpenAI's definitions (its API reference, "frequency and presence penalties"), applied in
this order to the unscaled logits, before temperature and the other warpers (as vLLM does):

- `logit_bias`: `{token_id: bias}` added to the token's logit (bias in [-100, 100]);
- `min_tokens` (vLLM's extension): the request's eos ids (its stop token ids too) are masked until
  it has generated `min_tokens` tokens;
- `presence_penalty` / `frequency_penalty` (in [-2, 2]):
  `logit[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty`, where `c[j]` counts token
  `j` in the completion so far (not the prompt).

Rows whose request leaves all four neutral (or has no sampling state) are not touched, and a step
where no row uses them returns `scores` as it is.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..request_state import RequestSampling, SampledRow


def apply(
    scores: torch.Tensor, requests: Sequence[SampledRow], states: list[RequestSampling | None]
) -> torch.Tensor:
    """Args: scores `[S, vocab]`; `requests[i]` (`.all_token_ids`, `.num_prompt_tokens`,
    `.eos_token_ids`) and `states[i]` own row i."""
    rows = [
        (i, state)
        for i, state in enumerate(states)
        if state is not None and state.params.uses_openai_processors
    ]
    if not rows:
        return scores
    scores = scores.clone()
    vocab = scores.shape[-1]
    for i, state in rows:
        params, request = state.params, requests[i]
        row = scores[i]
        if params.logit_bias:
            ids = torch.tensor([t for t, _ in params.logit_bias if t < vocab], dtype=torch.long)
            bias = torch.tensor([b for t, b in params.logit_bias if t < vocab], dtype=row.dtype)
            row.index_add_(0, ids.to(row.device), bias.to(row.device))
        generated = request.all_token_ids[request.num_prompt_tokens :]
        if params.min_tokens and len(generated) < params.min_tokens and request.eos_token_ids:
            eos = [t for t in request.eos_token_ids if t < vocab]
            row[torch.tensor(eos, dtype=torch.long, device=row.device)] = -float("inf")
        if params.presence_penalty or params.frequency_penalty:
            counts = state.generated_counts(generated, vocab, row.device).to(row.dtype)
            row -= counts * params.frequency_penalty + (counts > 0).to(row.dtype) * params.presence_penalty
    return scores
