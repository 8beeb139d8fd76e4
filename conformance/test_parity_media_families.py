"""Greedy parity with images for the judged families (issue 39): llava, llava-next, qwen2-vl,
qwen2.5-vl, qwen3-vl (deepstack features carried to the decoder layers), idefics3, smolvlm, internvl and
mistral3, tiny models from the coverage matrix's configs with their smallest images, processor-shaped
inputs. One batch mixes a request with one image, a text-only one and one with two images, with the
default budget and one of 5 tokens (chunks cut the images). Gemma 3 is refused with the reason."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

import transformers_cb  # noqa: F401  (installs the plugin)
from tests.support.vision_models import (
    JUDGED_FAMILIES,
    build_family_vlm,
    family_images,
    family_prompt,
    family_reference,
    image_token_of,
)
from transformers_cb import ContinuousBatchingConfig, RequestStatus

MAX_NEW_TOKENS = 8
TEXT = [[23, 24, 32, 33, 34], [25, 26, 27, 28, 29, 30, 31], [24, 25, 32, 33, 34]]
IMAGES_PER_PROMPT = (1, 0, 2)


@pytest.mark.parametrize("family", JUDGED_FAMILIES)
def test_family_with_images_equals_generate(family) -> None:
    model = build_family_vlm(family)
    media = [family_images(model, family, seed, n) if n else {} for seed, n in enumerate(IMAGES_PER_PROMPT)]
    prompts = [
        family_prompt(model, family, images, text) if images else text
        for images, text in zip(media, TEXT, strict=True)
    ]
    references = [
        family_reference(model, family, prompt, images, MAX_NEW_TOKENS)
        for prompt, images in zip(prompts, media, strict=True)
    ]
    inputs = [
        {"input_ids": torch.tensor([prompt]), **images} for prompt, images in zip(prompts, media, strict=True)
    ]
    for budget in (None, 5):
        results = model.generate_batch(
            inputs,
            GenerationConfig(max_new_tokens=MAX_NEW_TOKENS, do_sample=False),
            continuous_batching_config=ContinuousBatchingConfig(max_batch_tokens=budget) if budget else None,
            progress_bar=False,
            top_logprobs=1,
        )
        for i, (tokens, logprobs) in enumerate(references):
            output = results[f"req_{i}"]
            assert output.status == RequestStatus.FINISHED, (family, budget, i, output.error)
            assert output.generated_tokens == tokens, (family, budget, i)
            assert output.logprobs == pytest.approx(logprobs, abs=1e-4), (family, budget, i)


def test_gemma3_images_are_refused_with_the_reason() -> None:
    model = build_family_vlm("gemma3")
    images = family_images(model, "gemma3", 0, 1)
    prompt = [23, 24, *[image_token_of(model)] * 4, 32]
    with pytest.raises(ValueError, match="bidirectionally"):
        model.generate_batch(
            [{"input_ids": torch.tensor([prompt]), **images}],
            GenerationConfig(max_new_tokens=2, do_sample=False),
            progress_bar=False,
        )
    # The reason holds: generate()'s prefill mask from token_type_ids (an image block attending both ways)
    # changes the logits against the causal mask the paged kernels apply.
    ids = torch.tensor([prompt])
    types = (ids == image_token_of(model)).long()
    with torch.inference_mode():
        both_ways = model(ids, token_type_ids=types, **images).logits
        causal = model(ids, **images).logits
    assert torch.equal(both_ways[0, :2], causal[0, :2])  # text before the image: the same
    assert not torch.allclose(both_ways[0, 2:], causal[0, 2:], atol=1e-4)  # the image's and after: not
    # Its text path still runs.
    results = model.generate_batch(
        [TEXT[1]], GenerationConfig(max_new_tokens=2, do_sample=False), progress_bar=False
    )
    assert results["req_0"].status == RequestStatus.FINISHED
