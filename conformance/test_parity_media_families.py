"""Greedy parity with images for the judged families (issue 39): llava, llava-next, qwen2-vl,
qwen2.5-vl, qwen3-vl (deepstack features carried to the decoder layers), idefics3, smolvlm, internvl,
mistral3 and gemma3, tiny models from the coverage matrix's configs with their smallest images, processor-shaped
inputs. One batch mixes a request with one image, a text-only one and one with two images, with the
default budget and one of 5 tokens (chunks cut the images; Gemma 3's are cut before its images, whose
placeholders attend to each other both ways)."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

import transformers_cb  # noqa: F401  (installs the plugin)
from conformance.common import check_media_outputs, run_media_batch
from tests.support.vision_models import (
    JUDGED_FAMILIES,
    build_family_vlm,
    family_extras,
    family_images,
    family_prompt,
    family_reference,
    image_token_of,
)
from transformers_cb import ContinuousBatchingConfig

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
        {
            "input_ids": torch.tensor([prompt]),
            **images,
            **(family_extras(model, family, prompt) if images else {}),
        }
        for prompt, images in zip(prompts, media, strict=True)
    ]
    for budget in (None, 5):
        config = ContinuousBatchingConfig(max_batch_tokens=budget) if budget else None
        check_media_outputs(
            run_media_batch(model, inputs, MAX_NEW_TOKENS, config), references, family, budget
        )


def test_gemma3_blocks_attend_both_ways_as_generate_does(monkeypatch) -> None:
    """generate()'s prefill mask from `token_type_ids` lets an image's placeholders attend to each other both
    ways; the engine widens the chunk's mask to each block (runner/packing.py) and never ends a chunk inside
    one. Without the widening the answers differ; a block longer than the budget is refused up front."""
    model = build_family_vlm("gemma3")
    images = family_images(model, "gemma3", 0, 1)
    prompt = family_prompt(model, "gemma3", images, TEXT[0])
    extras = family_extras(model, "gemma3", prompt)
    ids = torch.tensor([prompt])
    first = prompt.index(image_token_of(model))
    with torch.inference_mode():
        both_ways = model(ids, token_type_ids=extras["token_type_ids"], **images).logits
        causal = model(ids, **images).logits
    assert torch.equal(both_ways[0, :first], causal[0, :first])  # text before the image: the same
    assert not torch.allclose(
        both_ways[0, first:], causal[0, first:], atol=1e-4
    )  # the image's and after: not
    tokens, logprobs = family_reference(model, "gemma3", prompt, images, MAX_NEW_TOKENS)
    inputs = [{"input_ids": ids, **images, **extras}]
    config = GenerationConfig(max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    output = model.generate_batch(inputs, config, progress_bar=False, top_logprobs=1)["req_0"]
    assert (output.generated_tokens, output.logprobs) == (tokens, pytest.approx(logprobs, abs=1e-4))
    import transformers_cb.runner.packing as packing

    monkeypatch.setattr(packing, "blocks_in", lambda entry: [])  # causal chunks: what the kernels did before
    output = model.generate_batch(inputs, config, progress_bar=False, top_logprobs=1)["req_0"]
    assert (output.generated_tokens, output.logprobs) != (tokens, pytest.approx(logprobs, abs=1e-4))
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"image block of 4 tokens .* max_batch_tokens \(3\)"):
        model.generate_batch(
            inputs,
            config,
            continuous_batching_config=ContinuousBatchingConfig(max_batch_tokens=3),
            progress_bar=False,
        )


def test_gemma3_under_preemption_and_prefix_sharing() -> None:
    """A cache just big enough for the largest request (requests are preempted and recompute their blocks),
    prefix sharing on for two requests with the same image, 4-token pages, 5-token chunks: still `generate()`'s."""
    import math

    from tests.support.preemptions import count_preemptions

    model = build_family_vlm("gemma3")
    media = [family_images(model, "gemma3", seed, n) for seed, n in ((0, 1), (0, 1), (1, 2))]
    texts = [TEXT[0], [23, 24, 40, 41, 42, 43], TEXT[2]]
    prompts = [family_prompt(model, "gemma3", m, t) for m, t in zip(media, texts, strict=True)]
    references = [
        family_reference(model, "gemma3", p, m, MAX_NEW_TOKENS) for p, m in zip(prompts, media, strict=True)
    ]
    inputs = [
        {"input_ids": torch.tensor([p]), **m, **family_extras(model, "gemma3", p)}
        for p, m in zip(prompts, media, strict=True)
    ]
    pages = math.ceil((max(map(len, prompts)) + MAX_NEW_TOKENS) / 4) + 1
    config = ContinuousBatchingConfig(
        num_blocks=pages, page_size=4, max_batch_tokens=5, allow_block_sharing=True
    )
    with count_preemptions() as preemptions:
        outputs = run_media_batch(model, inputs, MAX_NEW_TOKENS, config)
    assert preemptions
    check_media_outputs(outputs, references)


def test_gemma4_images_equal_generate_and_vision_blocks_are_refused(monkeypatch) -> None:
    """Gemma 4 (patches with `image_position_ids`, per-layer embeddings computed from the ids with its
    placeholders as pad, as its forward does): one image, text only, two images in 5-token chunks equal
    `generate()`. With `use_bidirectional_attention="vision"` generate() lets each run of vision tokens attend
    both ways on the sliding layers (from `mm_token_type_ids`): refused with the reason, never run causally."""
    import conformance.coverage.media as media
    from conformance.coverage.catalog import all_entries, select
    from transformers_cb.engine.intake.media_inputs import MediaIntake

    entry = select(all_entries(), ["gemma4"])[0]
    outcome = media.run_media(entry)
    assert (outcome.state, outcome.notes) == ("exact", "inputs: patches + image_position_ids"), outcome
    real = media.entry_config

    def vision_blocks(e):
        config = real(e)
        config.get_text_config().use_bidirectional_attention = "vision"
        return config

    monkeypatch.setattr(media, "entry_config", vision_blocks)
    refusal = MediaIntake.of(media.media_model(entry)).refusal
    assert refusal is not None and "mm_token_type_ids" in refusal
    outcome = media.run_media(entry)
    assert outcome.state == "refused" and "bidirectional" in outcome.reason, outcome
