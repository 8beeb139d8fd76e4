"""Greedy parity with images (issue 39): `generate_batch` and the manager equal `generate()` on a tiny
Llava given the same processor-shaped inputs, tokens and logprobs (docs/multimodal.md).

Mixed batches (text-only and image requests, several images per request), prefill chunks that cut an
image's placeholders in two (a token budget of 5 against 4 placeholders per image), preemption under a
cache just big enough for the largest request (recompute encodes the image again), prefix hits on a
shared image, and a request whose media the encoder refuses failing alone.
"""

from __future__ import annotations

import math

import pytest
from transformers import GenerationConfig

import transformers_cb  # noqa: F401  (installs the plugin)
from conformance.common import check_media_outputs, run_media_batch
from tests.support.preemptions import count_preemptions
from tests.support.vision_models import build_tiny_llava, llava_image, media_reference, with_images
from transformers_cb import ContinuousBatchingConfig, RequestStatus

MAX_NEW_TOKENS = 8

PROMPTS = [
    with_images([[1, 5, 6], 0, [7, 8], 1, [9]]),  # two images
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10],  # text only
    with_images([[3], 0, [11, 12]]),
    with_images([0, [20, 21, 22, 23, 24, 25]]),  # the image first
]
IMAGES = [llava_image(1, 2), None, llava_image(2), llava_image(3)]


@pytest.fixture(scope="module")
def llava():
    return build_tiny_llava(seed=0)


@pytest.fixture(scope="module")
def references(llava):
    return [
        media_reference(llava, prompt, {} if image is None else {"pixel_values": image}, MAX_NEW_TOKENS)
        for prompt, image in zip(PROMPTS, IMAGES, strict=True)
    ]


def run(model, cb_config=None, prompts=PROMPTS, images=IMAGES, **kwargs):
    return run_media_batch(model, prompts, MAX_NEW_TOKENS, cb_config, pixel_values=images, **kwargs)


@pytest.mark.parametrize("max_batch_tokens", [None, 5, 3])
def test_images_in_a_mixed_batch_equal_generate(llava, references, max_batch_tokens) -> None:
    """Budgets of 5 and 3 tokens cut every image's 4 placeholders across prefill chunks."""
    config = ContinuousBatchingConfig(max_batch_tokens=max_batch_tokens) if max_batch_tokens else None
    check_media_outputs(run(llava, config), references)


def test_processor_outputs_as_inputs_equal_generate(llava, references) -> None:
    """`inputs` given as the processor's dicts (`input_ids` [1, L] plus its tensors)."""
    import torch

    inputs = [
        {"input_ids": torch.tensor([prompt])} | ({} if image is None else {"pixel_values": image})
        for prompt, image in zip(PROMPTS, IMAGES, strict=True)
    ]
    results = llava.generate_batch(
        inputs, GenerationConfig(max_new_tokens=MAX_NEW_TOKENS, do_sample=False), progress_bar=False
    )
    assert [results[f"req_{i}"].generated_tokens for i in range(len(PROMPTS))] == [t for t, _ in references]


def test_preemption_recomputes_the_images(llava, references) -> None:
    page_size = 4
    pages = math.ceil((max(map(len, PROMPTS)) + MAX_NEW_TOKENS) / page_size) + 1
    config = ContinuousBatchingConfig(num_blocks=pages, page_size=page_size, max_batch_tokens=6)
    with count_preemptions() as preemptions:
        outputs = run(llava, config)
    assert preemptions
    check_media_outputs(outputs, references)


def test_a_shared_image_hits_the_prefix_cache_and_another_image_does_not(llava) -> None:
    """Same tokens, one after the other: with the same image the second request takes the cached pages
    past both images (positions 4-11); with another image only the page of text before the first image. Both equal
    `generate()` with their own image."""
    prompt = with_images([[1, 2, 3, 4], 0, 1, [5, 6, 7, 8, 9, 10, 11]])  # 23 tokens, the image from 4 on
    first, other = llava_image(7, 2), llava_image(8, 2)
    config = ContinuousBatchingConfig(page_size=4, allow_block_sharing=True)
    for second, hit_range in ((first, range(12, 21)), (other, range(4, 5))):
        manager = llava.init_continuous_batching(
            generation_config=GenerationConfig(max_new_tokens=MAX_NEW_TOKENS, do_sample=False),
            continuous_batching_config=config,
        )
        manager.start()
        try:
            for image in (first, second):
                tokens, _ = media_reference(llava, prompt, {"pixel_values": image}, MAX_NEW_TOKENS)
                request_id = manager.add_request(prompt, max_new_tokens=MAX_NEW_TOKENS, pixel_values=image)
                assert manager.get_result(request_id, timeout=120).generated_tokens == tokens
            assert manager.stats().prefix_cache_hit_tokens in hit_range  # past both images, or none of them
        finally:
            manager.stop(block=True)


def test_the_manager_takes_images_and_a_bad_image_fails_alone(llava, references) -> None:
    import torch

    manager = llava.init_continuous_batching(
        generation_config=GenerationConfig(max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    )
    manager.start()
    try:
        # Right placeholder count for the shapes' checks, wrong for the encoder: 3 images' rows for 8 placeholders.
        bad = manager.add_request(PROMPTS[0], max_new_tokens=MAX_NEW_TOKENS, pixel_values=llava_image(5, 4))
        ids = [
            manager.add_request(prompt, max_new_tokens=MAX_NEW_TOKENS, pixel_values=image)
            for prompt, image in zip(PROMPTS, IMAGES, strict=True)
        ]
        failed = manager.get_result(bad, timeout=120)
        assert failed.status == RequestStatus.FAILED
        assert "16 rows for 8 placeholder tokens" in (failed.error or "")
        for request_id, (tokens, _) in zip(ids, references, strict=True):
            assert manager.get_result(request_id, timeout=120).generated_tokens == tokens
        stats = manager.stats()  # every image encoded once, the store empty again (the failed request's too)
        assert stats.media_items_encoded == 4 and stats.media_encode_seconds > 0
        assert stats.media_store_rows == 0 and stats.media_store_capacity > 0
        with pytest.raises(ValueError, match="no image input was given"):
            manager.add_request(PROMPTS[0], max_new_tokens=2)
        with pytest.raises(ValueError, match="pixel_values must be a tensor"):
            manager.add_request(PROMPTS[0], max_new_tokens=2, pixel_values=[[0.0]])
        with pytest.raises(ValueError, match="no image placeholder token"):
            manager.add_request(PROMPTS[1], max_new_tokens=2, pixel_values=llava_image(1))
        with pytest.raises(ValueError, match="do not split evenly"):
            manager.add_request(PROMPTS[0], max_new_tokens=2, pixel_values=torch.zeros(3, 3, 28, 28))
    finally:
        manager.stop(block=True)


@pytest.fixture(scope="module")
def qwen2_vl():
    from tests.support.vision_models import build_tiny_qwen2_vl

    return build_tiny_qwen2_vl(seed=0)


@pytest.mark.parametrize("max_batch_tokens", [None, 5])
def test_qwen2_vl_m_rope_positions_equal_generate(qwen2_vl, max_batch_tokens) -> None:
    """3-D positions from the model's `get_rope_index`, the rope delta carried into decode: one image,
    text only, and two images of different grids in one request, chunked across the images."""
    import torch

    from tests.support.vision_models import (
        QWEN2_VL_IMAGE_TOKEN,
        mm_token_type_ids,
        qwen2_vl_image,
        qwen2_vl_placeholders,
    )

    one, two = qwen2_vl_image(1), qwen2_vl_image(2, 4, 8)
    prompts = [
        [1, 5, 6, *qwen2_vl_placeholders(), 7, 8, 9],
        [1, 3, 4, 5, 6, 7, 8, 9],
        [3, *qwen2_vl_placeholders(), 4, *qwen2_vl_placeholders(4, 8), 11, 12],
    ]
    media = [
        one,
        {},
        {key: torch.cat([one[key], two[key]]) for key in one},
    ]
    references = [
        media_reference(
            qwen2_vl,
            prompt,
            {**m, "mm_token_type_ids": mm_token_type_ids(prompt, QWEN2_VL_IMAGE_TOKEN)} if m else {},
            MAX_NEW_TOKENS,
        )
        for prompt, m in zip(prompts, media, strict=True)
    ]
    inputs = [{"input_ids": torch.tensor([prompt]), **m} for prompt, m in zip(prompts, media, strict=True)]
    config = ContinuousBatchingConfig(max_batch_tokens=max_batch_tokens) if max_batch_tokens else None
    check_media_outputs(run_media_batch(qwen2_vl, inputs, MAX_NEW_TOKENS, config), references)


def test_cpu_offload_swaps_requests_mid_image(llava, references) -> None:
    """A cache too small for all requests with a host tier: preempted requests swap out (with a 3-token budget,
    possibly between two chunks of an image), come back, are encoded again where placeholders remain, and equal `generate()`;
    with two sequences per input, the siblings fork after the prompt."""
    from conformance.test_parity_offload import engines_checked

    page_size = 4
    pages = math.ceil((max(map(len, PROMPTS)) + MAX_NEW_TOKENS) / page_size) + 2
    config = ContinuousBatchingConfig(
        num_blocks=pages, page_size=page_size, max_batch_tokens=3, cpu_offload_space=None
    )
    with engines_checked() as engines, count_preemptions() as preemptions:
        results = llava.generate_batch(
            PROMPTS,
            GenerationConfig(max_new_tokens=MAX_NEW_TOKENS, do_sample=False),
            continuous_batching_config=config,
            progress_bar=False,
            pixel_values=IMAGES,
            num_return_sequences=2,
        )
    (engine,) = engines
    assert preemptions and engine.offload.swap_out_pages > 0
    for i, (tokens, _) in enumerate(references):
        for request_id in (f"req_{i}", f"req_{i}__child#0"):
            assert results[request_id].generated_tokens == tokens, request_id


def test_qwen2_vl_video_equals_generate(qwen2_vl) -> None:
    """A video (4 frames: 2 temporal patches of a 4x4 grid, 8 placeholders) through `get_video_features`,
    its 3-D positions from the grid, beside a request with an image and a text-only one, in 5-token chunks."""
    import torch

    from tests.support.vision_models import (
        QWEN2_VL_IMAGE_TOKEN,
        QWEN2_VL_VISION_END,
        QWEN2_VL_VISION_START,
        qwen2_vl_image,
        qwen2_vl_placeholders,
    )

    video_token = qwen2_vl.config.video_token_id
    video = {
        "pixel_values_videos": torch.randn(32, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(4)),
        "video_grid_thw": torch.tensor([[2, 4, 4]]),
    }
    prompts = [
        [1, 5, QWEN2_VL_VISION_START, *[video_token] * 8, QWEN2_VL_VISION_END, 7, 8],
        [1, 3, *qwen2_vl_placeholders(), 9],
        [1, 3, 4, 5],
    ]
    media = [video, qwen2_vl_image(5), {}]
    types = [
        2 * (torch.tensor([prompts[0]]) == video_token).int(),
        (torch.tensor([prompts[1]]) == QWEN2_VL_IMAGE_TOKEN).int(),
    ]
    references = [
        media_reference(qwen2_vl, prompts[0], {**video, "mm_token_type_ids": types[0]}, MAX_NEW_TOKENS),
        media_reference(qwen2_vl, prompts[1], {**media[1], "mm_token_type_ids": types[1]}, MAX_NEW_TOKENS),
        media_reference(qwen2_vl, prompts[2], {}, MAX_NEW_TOKENS),
    ]
    inputs = [{"input_ids": torch.tensor([p]), **m} for p, m in zip(prompts, media, strict=True)]
    config = ContinuousBatchingConfig(max_batch_tokens=5)
    check_media_outputs(run_media_batch(qwen2_vl, inputs, MAX_NEW_TOKENS, config), references)
