"""Shared helpers of the conformance suite: references, parity checks, tolerances (the tiny models, the
prompts and the packed kernel steps are in tests/support/)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch
from transformers import GenerationConfig, PreTrainedModel

import transformers_cb  # noqa: F401  (installs the plugin)
from tests.support.preemptions import count_preemptions
from transformers_cb.config import ContinuousBatchingConfig
from transformers_cb.conformance_check import (
    Mismatch,
    compare_tokens,
    first_difference,
    greedy_config,
    reference_greedy,
)
from transformers_cb.requests import GenerationOutput, RequestStatus

__all__ = [
    "Mismatch",
    "compare_tokens",
    "count_preemptions",
    "first_difference",
    "greedy_config",
    "reference_greedy",
]


class ReferenceCache:
    """`generate()` outputs per (prompt, eos), computed once with max_new_tokens = `max_new_tokens`.

    With eos disabled, greedy decoding of k tokens is the first k tokens of decoding more,
    so shorter requests are served from the prefix.
    """

    def __init__(self, model: PreTrainedModel, max_new_tokens: int) -> None:
        self.model = model
        self.max_new_tokens = max_new_tokens
        self._cache: dict[tuple, list[int]] = {}

    def get(
        self,
        prompt: Sequence[int],
        max_new_tokens: int | None = None,
        eos_token_id: int | list[int] | None = None,
    ) -> list[int]:
        max_new_tokens = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        assert max_new_tokens <= self.max_new_tokens
        if eos_token_id is not None:  # eos outputs are not prefix-closed in max_new_tokens
            eos_key = tuple(eos_token_id) if isinstance(eos_token_id, list) else eos_token_id
            key = (tuple(prompt), max_new_tokens, eos_key)
            if key not in self._cache:
                self._cache[key] = self._generate(prompt, max_new_tokens, eos_token_id)
            return self._cache[key]
        key = (tuple(prompt), self.max_new_tokens, None)
        if key not in self._cache:
            self._cache[key] = self._generate(prompt, self.max_new_tokens, None)
        return self._cache[key][:max_new_tokens]

    def _generate(self, prompt: Sequence[int], max_new_tokens: int, eos_token_id) -> list[int]:
        saved = self.model.generation_config.eos_token_id
        self.model.generation_config.eos_token_id = eos_token_id
        try:
            return reference_greedy(self.model, prompt, greedy_config(max_new_tokens, eos_token_id))
        finally:
            self.model.generation_config.eos_token_id = saved


def check_parity(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    outputs: dict[str, GenerationOutput],
    references: Sequence[Sequence[int]],
    context: str = "",
    max_new_tokens: int | Sequence[int] | None = None,
    eos_token_id: int | list[int] | None = None,
) -> None:
    """Fail on any difference with generate() that is not a genuine floating-point near-tie.

    Tie-aware: where the outputs part at a near-tie (the reference's top-2 logits within the
    tolerance), the divergence is accepted and the rest of the output is checked against `generate()`
    continued from the same prefix (the output's own tokens up to and including the tie). So the test
    passes or fails on real differences only, and never hides one behind an `xfail`.
    `max_new_tokens` (default: each reference's length) and `eos_token_id` are those of the requests,
    for the continuations. Request ids are `req_<index>`."""
    expected_ids = [f"req_{i}" for i in range(len(prompts))]
    assert sorted(outputs) == sorted(expected_ids), f"{context}: ids {sorted(outputs)} != {expected_ids}"
    if max_new_tokens is None or isinstance(max_new_tokens, int):
        limits = [max_new_tokens or len(ref) for ref in references]
    else:
        limits = list(max_new_tokens)
    failures = []
    for i, (prompt, expected) in enumerate(zip(prompts, references, strict=True)):
        output = outputs[f"req_{i}"]
        assert output.status == RequestStatus.FINISHED, (
            f"{context}: req_{i} ended {output.status.name}: {output.error}"
        )
        assert output.prompt_ids == list(prompt), f"{context}: req_{i} prompt_ids changed"
        mismatch, ties = tie_aware_mismatch(
            model, f"req_{i}", prompt, expected, output.generated_tokens, limits[i], eos_token_id
        )
        if mismatch is not None:
            failures.append("\n\n".join(m.describe() for m in [mismatch, *ties]))
    if failures:
        pytest.fail(f"{context}\n" + "\n\n".join(failures), pytrace=False)


def tie_aware_mismatch(
    model: PreTrainedModel,
    request_id: str,
    prompt: Sequence[int],
    expected: Sequence[int],
    actual: Sequence[int],
    max_new_tokens: int,
    eos_token_id: int | list[int] | None = None,
) -> tuple[Mismatch | None, list[Mismatch]]:
    """(first real mismatch or None, the near-ties accepted on the way). At each near-tie the reference
    becomes `actual[: index + 1]` + greedy `generate()` continued from there."""
    ties: list[Mismatch] = []
    eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
    expected = list(expected)
    while True:
        mismatch = compare_tokens(model, request_id, prompt, expected, actual)
        if mismatch is None or not mismatch.is_near_tie:
            return mismatch, ties
        ties.append(mismatch)
        prefix = list(actual[: mismatch.index + 1])
        remaining = max_new_tokens - len(prefix)
        continuation: list[int] = []
        if remaining > 0 and prefix[-1] not in eos:
            continuation = reference_greedy(model, [*prompt, *prefix], greedy_config(remaining, eos_token_id))
        expected = prefix + continuation


def run_batch(
    model: PreTrainedModel,
    prompts,
    generation_config: GenerationConfig,
    max_new_tokens: int | list[int] | None = None,
    **cb_kwargs,
):
    """`generate_batch` with `ContinuousBatchingConfig(**cb_kwargs)`; returns (outputs, preempted ids)."""
    from transformers_cb import ContinuousBatchingConfig

    kwargs = {} if max_new_tokens is None else {"max_new_tokens": max_new_tokens}
    with count_preemptions() as preemptions:
        outputs = model.generate_batch(
            [list(p) for p in prompts],
            generation_config=generation_config,
            continuous_batching_config=ContinuousBatchingConfig(**cb_kwargs),
            progress_bar=False,
            **kwargs,
        )
    return outputs, preemptions


def tight_num_blocks(prompts: Sequence[Sequence[int]], max_new_tokens: int, page_size: int) -> int:
    """Just enough pages for the largest single request, plus one."""
    return math.ceil((max(map(len, prompts)) + max_new_tokens) / page_size) + 1


def check_parity_under_eviction(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    references: ReferenceCache,
    context: str,
    page_size: int = 4,
    max_batch_tokens: int = 16,
    **cb_kwargs,
) -> dict[str, GenerationOutput]:
    """Run `prompts` greedily (`references.max_new_tokens` each) with pages for only the largest request
    (`tight_num_blocks`), so requests are preempted and resumed, and fail when none was (the run would not
    exercise eviction) or on a real difference with `generate()` (`check_parity`). `cb_kwargs`: the rest of
    the config (`cpu_offload_space`, `return_logprobs`); returns the outputs for a caller's further checks."""
    max_new_tokens = references.max_new_tokens
    num_blocks = tight_num_blocks(prompts, max_new_tokens, page_size)
    context = (
        f"{context} / page_size={page_size}, max_batch_tokens={max_batch_tokens}, num_blocks={num_blocks}"
    )
    outputs, preemptions = run_batch(
        model,
        prompts,
        greedy_config(max_new_tokens),
        page_size=page_size,
        max_batch_tokens=max_batch_tokens,
        num_blocks=num_blocks,
        **cb_kwargs,
    )
    assert preemptions, f"{context}: no request was preempted; the run does not exercise eviction"
    check_parity(model, prompts, outputs, [references.get(p) for p in prompts], context)
    return outputs


# -- media ----------------------------------------------------------------------------------------
def run_media_batch(
    model: PreTrainedModel,
    inputs: Sequence,
    max_new_tokens: int,
    cb_config: ContinuousBatchingConfig | None = None,
    **kwargs,
) -> list[GenerationOutput]:
    """`generate_batch` greedy with each token's logprob (`top_logprobs=1`) on processor-shaped `inputs`
    (or token lists with `kwargs` such as `pixel_values`): the outputs in request order."""
    results = model.generate_batch(
        inputs,
        GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False),
        continuous_batching_config=cb_config,
        progress_bar=False,
        top_logprobs=1,
        **kwargs,
    )
    return [results[f"req_{i}"] for i in range(len(inputs))]


def check_media_outputs(
    outputs: Sequence[GenerationOutput], references: Sequence[tuple[list[int], list]], *label
) -> None:
    """Each output finished with the tokens of its `generate()` reference `(tokens, logprobs)` and its
    logprobs within 1e-4 (a media run's judgement: its tiny models have no near-ties to excuse); `label`
    names the run in a failure."""
    for i, (output, (tokens, logprobs)) in enumerate(zip(outputs, references, strict=True)):
        assert output.status == RequestStatus.FINISHED, (*label, i, output.error)
        assert output.generated_tokens == tokens, (*label, i)
        assert output.logprobs == pytest.approx(logprobs, abs=1e-4), (*label, i)


# -- tensors ----------------------------------------------------------------------------------------
def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float, msg: str = ""
) -> None:
    """`torch.testing`-style closeness, with max/mean abs diff and the worst index in the message."""
    assert actual.shape == expected.shape, f"{msg}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    actual, expected = actual.float(), expected.float()
    assert torch.isfinite(actual).all(), f"{msg}: non-finite values in the result"
    diff = (actual - expected).abs()
    bad = diff > atol + rtol * expected.abs()
    if bad.any():
        worst = int(diff.argmax())
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), diff.shape))
        raise AssertionError(
            f"{msg}: {int(bad.sum())}/{diff.numel()} elements differ beyond atol={atol:g} rtol={rtol:g}; "
            f"max abs diff {diff.max().item():.3g} at {index} "
            f"(actual {actual[index].item():.6g}, expected {expected[index].item():.6g}), "
            f"mean abs diff {diff.mean().item():.3g}"
        )


TOLERANCES = {torch.float32: (2e-5, 2e-4), torch.bfloat16: (3e-2, 3e-2), torch.float16: (5e-3, 5e-3)}
