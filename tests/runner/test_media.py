"""The runner's media (runner/media/media_runner.py): encoding into the store (joined across requests where shapes
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
from transformers_cb.engine.intake.media_inputs import MediaIntake
from transformers_cb.requests import Request
from transformers_cb.runner.media.media_runner import MediaRunner, MediaStepInputs
from transformers_cb.scheduler.step_plan import ScheduledRequest


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


class _PerLayerText(torch.nn.Module):
    """A language model with per-layer token embeddings (Gemma 4's `get_per_layer_inputs`): ids x 10."""

    def get_per_layer_inputs(self, input_ids: torch.Tensor, inputs_embeds: torch.Tensor) -> torch.Tensor:
        return input_ids[..., None].float() * 10


class _PerLayerModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.language_model = _PerLayerText()
        self.seen: dict = {}
        text = type("Text", (), {"hidden_size_per_layer_input": 2, "pad_token_id": 0})()
        self.config = type("Config", (), {"get_text_config": lambda self: text})()

    def forward(self, per_layer_inputs=None) -> None:
        self.seen["per_layer_inputs"] = per_layer_inputs


def test_per_layer_inputs_come_from_the_ids_with_placeholders_as_pad() -> None:
    model = _PerLayerModel()
    runner = MediaRunner(model=model)  # type: ignore[arg-type]
    ids = torch.tensor([[5, 7, 7, 6]])
    fills = [(torch.tensor([1, 2]), torch.zeros(2, 3), [])]
    per_layer = runner._per_layer_inputs(ids, torch.zeros(1, 4, 3), fills)
    assert per_layer is not None and per_layer[0, :, 0].tolist() == [50.0, 0.0, 0.0, 60.0]
    with runner.carried(MediaStepInputs(inputs_embeds=torch.zeros(1, 4, 3), per_layer_inputs=per_layer)):
        model(per_layer_inputs=None)
    assert model.seen["per_layer_inputs"] is per_layer
    model(per_layer_inputs=None)  # the hook is gone after the step
    assert model.seen["per_layer_inputs"] is None


def test_no_per_layer_inputs_for_a_model_without_them(llava) -> None:
    fills = [(torch.tensor([0]), torch.zeros(1, 3), [])]
    assert (
        MediaRunner(model=llava)._per_layer_inputs(torch.tensor([[1]]), torch.zeros(1, 1, 3), fills) is None
    )
