"""Chat messages with images on the server (serve/media.py): data URLs only, bounded count and bytes,
`wav` audio decoded, and an image request through a processor equal to `generate()` on the same inputs.

Pillow is not a dependency, so the end-to-end test decodes its images with a test double of
`load_image` and renders them with a processor test double (the tokenizer's chat template, four
placeholder tokens per image, the decoded pixels as `pixel_values`): what is judged is the server's
path from content parts to the engine, not an image codec."""

from __future__ import annotations

import base64
import io
import wave
from typing import Any

import numpy as np
import pytest
import torch

from tests.support.serve import greedy_config, live_server, openai_client, tiny_model_and_tokenizer
from tests.support.vision_models import media_reference
from transformers_cb.serve import media
from transformers_cb.serve.protocol import ApiError, ChatCompletionRequest

IMAGE_TOKEN = 258  # byte 255 in the tiny byte-level tokenizer: never in ASCII text


def body(*parts: dict[str, Any]) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": list(parts)}]}
    )


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def data_url(pixels: np.ndarray) -> str:
    return "data:image/x-test;base64," + base64.b64encode(pixels.astype(np.float32).tobytes()).decode()


def test_remote_urls_are_refused_with_the_reason() -> None:
    with pytest.raises(ApiError, match="only data URLs are read") as error:
        media.processor_messages(body(image_part("https://example.com/cat.png")))
    assert error.value.status == 400 and error.value.param == "messages.0.content.0.image_url.url"


def test_bad_data_urls_name_the_field() -> None:
    with pytest.raises(ApiError, match="expected data:<type>;base64"):
        media.processor_messages(body(image_part("data:image/png,abc")))
    with pytest.raises(ApiError, match="not valid base64"):
        media.processor_messages(body(image_part("data:image/png;base64,@@@")))


def test_media_count_and_bytes_are_bounded(monkeypatch) -> None:
    monkeypatch.setattr(media, "load_image", lambda data, field: data)
    small = image_part(data_url(np.zeros(4)))
    media.processor_messages(body(*[small] * media.MAX_MEDIA_ITEMS))
    with pytest.raises(ApiError, match=f"at most {media.MAX_MEDIA_ITEMS} images"):
        media.processor_messages(body(*[small] * (media.MAX_MEDIA_ITEMS + 1)))
    monkeypatch.setattr(media, "MAX_MEDIA_BYTES", 20)
    with pytest.raises(ApiError, match="exceed 20 bytes"):
        media.processor_messages(body(small, small))


def test_wav_audio_is_decoded_and_other_formats_refused() -> None:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as clip:
        clip.setnchannels(2)
        clip.setsampwidth(2)
        clip.setframerate(16000)
        clip.writeframes(np.array([[16384, -16384], [32767, 32767]], dtype=np.int16).tobytes())
    encoded = base64.b64encode(buffer.getvalue()).decode()
    (message,) = media.processor_messages(
        body({"type": "input_audio", "input_audio": {"data": encoded, "format": "wav"}})
    )
    np.testing.assert_allclose(message["content"][0]["audio"], [0.0, 32767 / 32768], atol=1e-6)
    with pytest.raises(ApiError, match="only wav audio"):
        media.processor_messages(
            body({"type": "input_audio", "input_audio": {"data": encoded, "format": "mp3"}})
        )


def test_images_without_a_processor_are_a_400() -> None:
    with pytest.raises(ApiError, match="need the model's processor"):
        media.media_prompt(None, body(image_part(data_url(np.zeros(4)))), {})


class PlaceholderProcessor:
    """A processor test double: the tokenizer's chat template over the text, four placeholders for each
    image, the images' pixels as `pixel_values`."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def apply_chat_template(
        self, messages, add_generation_prompt, tokenize, return_dict, return_tensors, **kw
    ):
        images, flat = [], []
        for message in messages:
            text = ""
            for part in message["content"]:
                if part["type"] == "image":
                    images.append(part["image"])
                    text += "\0"
                else:
                    text += part["text"]
            flat.append({"role": message["role"], "content": text})
        rendered = self.tokenizer.apply_chat_template(flat, add_generation_prompt=True, tokenize=False, **kw)
        ids: list[int] = []
        for k, chunk in enumerate(rendered.split("\0")):
            ids += [IMAGE_TOKEN] * 4 if k else []
            ids += self.tokenizer.encode(chunk, add_special_tokens=False)
        return {
            "input_ids": torch.tensor([ids]),
            "attention_mask": torch.ones(1, len(ids)),
            "pixel_values": torch.cat(images),
        }


def tiny_llava_for(tokenizer: Any):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(0)
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    text = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=len(tokenizer), max_position_embeddings=512,
    )  # fmt: skip
    config = LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN, vision_feature_layer=-1
    )
    model = LlavaForConditionalGeneration(config).eval()
    model.generation_config = greedy_config(tokenizer)
    return model


def test_an_image_chat_equals_generate_on_the_processors_inputs(monkeypatch) -> None:
    _, tokenizer = tiny_model_and_tokenizer()
    model = tiny_llava_for(tokenizer)
    monkeypatch.setattr(
        media,
        "load_image",
        lambda data, field: torch.from_numpy(np.frombuffer(data, np.float32).reshape(1, 3, 28, 28).copy()),
    )
    pixels = np.random.default_rng(0).standard_normal((1, 3, 28, 28))
    processor = PlaceholderProcessor(tokenizer)
    content = [
        {"type": "text", "text": "what is"},
        image_part(data_url(pixels)),
        {"type": "text", "text": "?"},
    ]
    rendered = processor.apply_chat_template(media.processor_messages(body(*content)), True, True, True, "pt")
    prompt = rendered["input_ids"][0].tolist()
    tokens, _ = media_reference(
        model, prompt, {"pixel_values": rendered["pixel_values"], "eos_token_id": tokenizer.eos_token_id}, 8
    )
    with live_server(model, tokenizer) as live:
        live.state.processor = processor
        client = openai_client(live)
        answer = client.chat.completions.create(
            model="tiny-test", messages=[{"role": "user", "content": content}], max_tokens=8, temperature=0
        )
        assert answer.choices[0].message.content == tokenizer.decode(tokens, skip_special_tokens=True)
        with pytest.raises(Exception, match="only data URLs are read"):
            client.chat.completions.create(
                model="tiny-test",
                messages=[{"role": "user", "content": [image_part("https://example.com/x.png")]}],
                max_tokens=2,
            )
        # The server still answers after the refusal.
        again = client.chat.completions.create(
            model="tiny-test", messages=[{"role": "user", "content": content}], max_tokens=8, temperature=0
        )
        assert again.choices[0].message.content == answer.choices[0].message.content
