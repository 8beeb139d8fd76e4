"""The runner's media (runner/media.py): encoding into the store (joined across requests where shapes
allow, one request's bad media failing it alone), each chunk's rows placed at its prompt placeholders."""

from __future__ import annotations

import pytest
import torch

from tests.support.vision_models import (
    LLAVA_IMAGE_TOKEN,
    build_tiny_llava,
    llava_image,
    with_images,
)
from transformers_cb.engine.media_inputs import MediaIntake
from transformers_cb.requests import Request
from transformers_cb.runner.media import MediaRunner
from transformers_cb.scheduler.plan import ScheduledRequest


@pytest.fixture(scope="module")
def llava():
    return build_tiny_llava(seed=0)


def make(llava, request_id: str, parts, images: torch.Tensor) -> Request:
    prompt = with_images(parts)
    request = Request(request_id=request_id, prompt_ids=prompt, max_new_tokens=4)
    request.media = MediaIntake.of(llava).build(prompt, {"pixel_values": images}, request_id)
    return request


@torch.inference_mode()
def features(llava, images: torch.Tensor) -> torch.Tensor:
    output = llava.base_model.get_image_features(pixel_values=images, return_dict=True).pooler_output
    return torch.cat([item.reshape(-1, item.shape[-1]) for item in output])


@torch.inference_mode()
def test_joined_encoding_gives_each_request_its_own_rows(llava) -> None:
    runner = MediaRunner(llava)
    a, b = make(llava, "a", [[1], 0, [2]], llava_image(1)), make(llava, "b", [0, 1, [3]], llava_image(2, 2))
    assert runner.encode([a, b]) == {}
    torch.testing.assert_close(runner.store.get("a").rows["image"], features(llava, llava_image(1)))
    torch.testing.assert_close(runner.store.get("b").rows["image"], features(llava, llava_image(2, 2)))


@torch.inference_mode()
def test_a_request_whose_rows_do_not_match_fails_alone(llava) -> None:
    runner = MediaRunner(llava)
    good = make(llava, "good", [[1], 0, [2]], llava_image(1))
    bad = make(llava, "bad", [[1], 0, [2]], llava_image(1))
    bad.media.inputs["image"]["pixel_values"] = llava_image(3, 2)  # 8 rows for 4 placeholders
    failures = runner.encode([good, bad])
    assert list(failures) == ["bad"] and "8 rows for 4 placeholder tokens" in failures["bad"]
    assert "good" in runner.store and "bad" not in runner.store


@torch.inference_mode()
def test_chunks_read_the_rows_of_their_own_placeholders(llava) -> None:
    """A chunk [3, 6) of `[1, 2, 3, IMG x4, 4]` holds placeholders 3, 4, 5: rows 0-2; the next chunk's
    placeholder 6 is row 3. A generated token equal to the placeholder id is left as it is."""
    runner = MediaRunner(llava)
    request = make(llava, "a", [[1, 2, 3], 0, [4]], llava_image(1))
    runner.encode([request])
    rows = runner.store.get("a").rows["image"]
    request.generated_ids.append(LLAVA_IMAGE_TOKEN)
    request.all_token_ids.append(LLAVA_IMAGE_TOKEN)
    embed = llava.get_input_embeddings()
    for start, end, placed in ((3, 6, {3: 0, 4: 1, 5: 2}), (6, 9, {6: 3})):
        entry = ScheduledRequest(request, start, end - start)
        ids = torch.tensor([request.all_token_ids[start:end]])
        inputs = runner.step_inputs([entry], ids)
        for offset, position in enumerate(range(start, end)):
            expected = rows[placed[position]] if position in placed else embed(ids[0, offset])
            torch.testing.assert_close(inputs.inputs_embeds[0, offset], expected)
    runner.after_step([ScheduledRequest(request, 6, 3)])
    assert "a" not in runner.store  # the last placeholder was read


def test_submission_checks_name_the_problem(llava) -> None:
    intake = MediaIntake.of(llava)
    prompt = with_images([[1], 0, [2]])
    with pytest.raises(ValueError, match="no image input was given"):
        intake.build(prompt, {}, "r")
    with pytest.raises(ValueError, match="holds NaN"):
        intake.build(prompt, {"pixel_values": torch.full((1, 3, 28, 28), float("nan"))}, "r")
    with pytest.raises(ValueError, match="'pixel_attention_mask' is not an input"):
        intake.build(prompt, {"pixel_values": llava_image(0), "pixel_attention_mask": torch.ones(1)}, "r")
    assert intake.build([1, 2, 3], {}, "r") is None
