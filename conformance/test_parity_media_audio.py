"""Greedy parity with audio (issue 39): a tiny Voxtral (its Whisper-style encoder through
`get_audio_features`, `input_features` as its feature extractor shapes them), one batch mixing a request
with one clip, a text-only one and one with two clips, whole prompts and 3-token chunks (chunks cut the
clips' placeholders), against `generate()` on each prompt alone: tokens equal, logprobs within 1e-4."""

from __future__ import annotations

import torch
from transformers import GenerationConfig

import transformers_cb  # noqa: F401  (installs the plugin)
from conformance.common import check_media_outputs, run_media_batch
from tests.support.vision_models import (
    VOXTRAL_AUDIO_TOKEN,
    VOXTRAL_ROWS_PER_CLIP,
    build_tiny_voxtral,
    media_reference,
    voxtral_clips,
)
from transformers_cb import ContinuousBatchingConfig, RequestStatus
from transformers_cb.engine.intake.media_inputs import MediaIntake

MAX_NEW_TOKENS = 8


def clip_tokens(count: int) -> list[int]:
    return [VOXTRAL_AUDIO_TOKEN] * (VOXTRAL_ROWS_PER_CLIP * count)


def test_voxtral_audio_equals_generate() -> None:
    model = build_tiny_voxtral()
    assert MediaIntake.of(model).token_ids == {"audio": VOXTRAL_AUDIO_TOKEN}
    prompts = [[5, 6, *clip_tokens(1), 7, 8], [9, 10, 11, 12, 13, 14], [15, *clip_tokens(2), 16, 17]]
    media = [{"input_features": voxtral_clips(0)}, {}, {"input_features": voxtral_clips(1, 2)}]
    references = [media_reference(model, p, m, MAX_NEW_TOKENS) for p, m in zip(prompts, media, strict=True)]
    inputs = [{"input_ids": torch.tensor([p]), **m} for p, m in zip(prompts, media, strict=True)]
    for budget in (None, 3):
        config = ContinuousBatchingConfig(max_batch_tokens=budget) if budget else None
        check_media_outputs(run_media_batch(model, inputs, MAX_NEW_TOKENS, config), references, budget)


def test_audio_that_does_not_match_its_placeholders_fails_that_request_alone() -> None:
    """Two clips for one clip's placeholders: the encoder's rows do not match, that request fails with
    the reason and the others finish."""
    model = build_tiny_voxtral()
    inputs = [
        {"input_ids": torch.tensor([[5, *clip_tokens(1), 6]]), "input_features": voxtral_clips(0, 2)},
        [7, 8, 9],
    ]
    results = model.generate_batch(
        inputs, GenerationConfig(max_new_tokens=2, do_sample=False), progress_bar=False
    )
    assert results["req_0"].status == RequestStatus.FAILED and "placeholder" in str(results["req_0"].error)
    assert results["req_1"].status == RequestStatus.FINISHED
