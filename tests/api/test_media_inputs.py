"""`generate_batch`'s media inputs (api/generate_batch.py): processor outputs as dicts, media keyword
arguments one per input, and the errors that name what is wrong."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

import transformers_cb  # noqa: F401  (installs the plugin)
from tests.support.models import build_tiny_model
from tests.support.vision_models import build_tiny_llava, llava_image, with_images

GREEDY = GenerationConfig(max_new_tokens=3, do_sample=False)


@pytest.fixture(scope="module")
def llava():
    return build_tiny_llava(seed=0)


def test_a_tokenizers_dict_runs_on_a_text_model() -> None:
    model = build_tiny_model("llama", seed=0)
    from_dict = model.generate_batch(
        [{"input_ids": torch.tensor([[5, 6, 7]]), "attention_mask": torch.ones(1, 3)}],
        GREEDY,
        progress_bar=False,
    )
    plain = model.generate_batch([[5, 6, 7]], GREEDY, progress_bar=False)
    assert from_dict["req_0"].generated_tokens == plain["req_0"].generated_tokens


def test_dict_inputs_and_media_kwargs_give_the_same_tokens(llava) -> None:
    prompt, image = with_images([[1, 2], 0, [3]]), llava_image(0)
    as_dict = llava.generate_batch(
        [{"input_ids": torch.tensor([prompt]), "pixel_values": image}, [4, 5]], GREEDY, progress_bar=False
    )
    as_kwargs = llava.generate_batch([prompt, [4, 5]], GREEDY, progress_bar=False, pixel_values=[image, None])
    assert [o.generated_tokens for o in as_dict.values()] == [o.generated_tokens for o in as_kwargs.values()]


@pytest.mark.parametrize(
    ("inputs", "kwargs", "message"),
    [
        ([{"pixel_values": torch.zeros(1)}], {}, r"inputs\[0\]: a dict input needs input_ids"),
        ([{"input_ids": torch.ones(2, 3, dtype=torch.long)}], {}, "holds 2 prompts"),
        (
            [[1, 2]],
            {"pixel_values": torch.zeros(1, 3, 28, 28)},
            "pixel_values: give a list with one value per input",
        ),
        ([[1, 2]], {"pixel_values": [None, None]}, "pixel_values: got 2 values for 1 inputs"),
        (
            [{"input_ids": torch.tensor([with_images([0])]), "pixel_values": llava_image(0)}],
            {"pixel_values": [llava_image(1)]},
            "given both in the input and as a keyword argument",
        ),
    ],
)
def test_bad_media_inputs_name_the_problem(llava, inputs, kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        llava.generate_batch(inputs, GREEDY, progress_bar=False, **kwargs)


def test_gemma3s_blocks_are_the_runs_of_its_token_type_ids_and_flash_refuses_them() -> None:
    """Gemma 3 declares blockwise prefill masks (engine/intake/media_inputs.py): its `token_type_ids` runs are the
    request's blocks, a wrong length is named, and a flash backend (causal varlen) refuses its images."""
    from tests.support.vision_models import build_family_vlm, family_images, image_token_of
    from transformers_cb.engine.intake.media_inputs import MediaIntake

    model = build_family_vlm("gemma3")
    intake = MediaIntake.of(model)
    assert intake.blockwise and intake.refusal is None
    token = image_token_of(model)
    prompt = [5, 6, *[token] * 4, 7, *[token] * 4, 8]
    images = family_images(model, "gemma3", 0, 2)
    types = (torch.tensor([prompt]) == token).long()
    media = intake.build(prompt, {**images, "token_type_ids": types}, "inputs[0]")
    assert media is not None and media.blocks == ((2, 6), (7, 11))
    assert intake.build(prompt, dict(images), "inputs[0]").blocks == ()  # generate() is causal without them
    with pytest.raises(ValueError, match=r"inputs\[0\]: token_type_ids must hold one value per prompt token"):
        intake.build(prompt, {**images, "token_type_ids": types[:, :-1]}, "inputs[0]")
    assert intake.on_backend("paged|sdpa") is intake
    flash = intake.on_backend("paged|flash_attention_2")
    assert flash.refusal is not None and "use paged|sdpa" in flash.refusal
    llava = MediaIntake.of(build_tiny_llava(seed=0))
    assert not llava.blockwise and llava.on_backend("paged|flash_attention_2") is llava
