"""Continuous batching against plain `generate()`: greedy references, the first difference, near-ties.

Shared by the conformance check (`check.py`) and the `conformance/` test suite.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import torch
from transformers import GenerationConfig, PreTrainedModel

# Below this logit gap between the reference's token and ours, a different greedy choice is a
# floating-point near-tie (two summation orders legitimately disagree), not a bug.
NEAR_TIE_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}
# ...or below this share of the top logit's magnitude in a reduced-precision model: its logits are rounded
# to 8 (bfloat16) or 11 (float16) significant bits, so at a bfloat16 logit of 25 two unequal logits are at
# least 0.125 apart (one ulp) and the absolute tolerance alone would accept exact ties only. 2^-6 is 2-4
# bfloat16 ulps of the top logit (2-4 float16 ulps with 2^-9).
NEAR_TIE_RELATIVE = {torch.bfloat16: 2.0**-6, torch.float16: 2.0**-9}


def near_tie_tolerance(dtype: torch.dtype, top_logit: float = 0.0) -> float:
    """The largest logit gap that counts as a near-tie for a model of `dtype` whose top logit at that
    position is `top_logit`."""
    return max(NEAR_TIE_TOLERANCE.get(dtype, 1e-4), NEAR_TIE_RELATIVE.get(dtype, 0.0) * abs(top_logit))


# -- references ------------------------------------------------------------------------------------
def greedy_config(
    max_new_tokens: int, eos_token_id: int | list[int] | None = None, **kwargs
) -> GenerationConfig:
    """Greedy decoding; `eos_token_id=None` disables eos (set `model.generation_config.eos_token_id`
    to None as well, or both `generate()` and `generate_batch` take the model's)."""
    return GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, num_beams=1, eos_token_id=eos_token_id, **kwargs
    )


@contextmanager
def plain_generation_config(model: PreTrainedModel, eos_token_id: int | list[int] | None) -> Iterator[None]:
    """Swap the model's generation config for a neutral greedy one (its bos/pad ids and `eos_token_id`),
    so that checkpoint defaults (sampling, repetition penalty, ...) do not enter the comparison."""
    saved = model.generation_config
    model.generation_config = GenerationConfig(
        bos_token_id=saved.bos_token_id, pad_token_id=saved.pad_token_id, eos_token_id=eos_token_id
    )
    try:
        yield
    finally:
        model.generation_config = saved


@torch.inference_mode()
def reference_greedy(
    model: PreTrainedModel, prompt: Sequence[int], generation_config: GenerationConfig
) -> list[int]:
    """`model.generate()` on `prompt` alone (batch of one, no padding); the generated ids only."""
    device = next(model.parameters()).device
    input_ids = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    # `generate` is `GenerationMixin`'s, typed with a `self` protocol that a `PreTrainedModel` does not
    # match statically; without `return_dict_in_generate` it returns the ids.
    output: torch.Tensor = cast(Any, model).generate(
        input_ids, attention_mask=torch.ones_like(input_ids), generation_config=generation_config
    )
    return output[0, input_ids.shape[1] :].tolist()


@torch.inference_mode()
def next_token_logits(model: PreTrainedModel, ids: Sequence[int]) -> torch.Tensor:
    """Float32 logits of the token after `ids`, from one plain full forward (no KV cache)."""
    device = next(model.parameters()).device
    input_ids = torch.tensor([list(ids)], dtype=torch.long, device=device)
    output = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), use_cache=False)
    return output.logits[0, -1].float()


# -- comparison --------------------------------------------------------------------------------------
@dataclass
class Mismatch:
    """First difference between the reference (`generate()`) and continuous batching for one prompt."""

    request_id: str
    prompt: list[int]
    expected: list[int]  # generate()
    actual: list[int]  # generate_batch
    index: int  # first differing position in the generated tokens
    margin: float | None = None  # logit(max) - logit(actual token) at `index`; None: a length mismatch
    top2_margin: float | None = None  # logit(top1) - logit(top2) at `index`
    tolerance: float = 1e-4

    @property
    def is_near_tie(self) -> bool:
        return self.margin is not None and self.margin < self.tolerance

    def describe(self, context: int = 4) -> str:
        lines = [
            f"{self.request_id}: generate_batch differs from generate() at generated position {self.index} "
            f"(prompt of {len(self.prompt)} tokens)",
            f"  generate():       {self.expected}",
            f"  generate_batch(): {self.actual}",
        ]
        if self.margin is None:
            lines.append(
                f"  lengths differ ({len(self.expected)} vs {len(self.actual)} tokens): stopping disagrees"
            )
        else:
            kind = "NEAR-TIE" if self.is_near_tie else "NOT a near-tie"
            lines.append(
                f"  reference logits at that position: top1-top2 = {self.top2_margin:.3g}, "
                f"max - logit(generate_batch's token) = {self.margin:.3g} ({kind}, tolerance {self.tolerance:g})"
            )
        lines.append("  pos | generate() | generate_batch()")
        end = max(len(self.expected), len(self.actual))
        for pos in range(max(0, self.index - context), min(end, self.index + context + 1)):
            expected = self.expected[pos] if pos < len(self.expected) else "-"
            actual = self.actual[pos] if pos < len(self.actual) else "-"
            marker = "  <-- first difference" if pos == self.index else ""
            lines.append(f"  {pos:>3} | {expected!s:>10} | {actual!s:>16}{marker}")
        return "\n".join(lines)


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_tokens(
    model: PreTrainedModel,
    request_id: str,
    prompt: Sequence[int],
    expected: Sequence[int],
    actual: Sequence[int],
    tolerance: float | None = None,
) -> Mismatch | None:
    """None when equal; else a `Mismatch` whose margin is measured with a plain forward of the model
    on `prompt + expected[:index]` (raw logits, before any logits processor). `tolerance`: the near-tie
    bound; None: `near_tie_tolerance` of the model's dtype and that position's top logit."""
    index = first_difference(expected, actual)
    if index is None:
        return None
    dtype = next(model.parameters()).dtype
    mismatch = Mismatch(
        request_id,
        list(prompt),
        list(expected),
        list(actual),
        index,
        tolerance=near_tie_tolerance(dtype) if tolerance is None else tolerance,
    )
    if index < min(len(expected), len(actual)):
        logits = next_token_logits(model, [*prompt, *expected[:index]])
        top2 = logits.topk(2).values
        mismatch.top2_margin = float(top2[0] - top2[1])
        mismatch.margin = float(logits.max() - logits[actual[index]])
        if tolerance is None:
            mismatch.tolerance = near_tie_tolerance(dtype, float(top2[0]))
    return mismatch
