"""Chat messages with images on the server (serve/chat/chat_media.py): data URLs only, bounded count and bytes,
`wav` audio decoded, and an image request through a processor equal to `generate()` on the same inputs.

Two paths: a processor test double (the tokenizer's chat template, four placeholder tokens per image, raw
pixels as `pixel_values`) judges the server's path from content parts to the engine alone; the served
checkpoint folder (a tiny Llava saved with its `LlavaProcessor`, loaded by `build_state` as the command
loads it) judges the real one: PNG and JPEG data URLs decoded by Pillow, rendered by the processor."""

from __future__ import annotations

import argparse
import base64
import io
import wave
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.support.serve import (
    LiveServer,
    greedy_config,
    live_server,
    openai_client,
    requires_serve,
    served_text,
    serving,
    tiny_model_and_tokenizer,
)
from tests.support.threads import TIMEOUT
from tests.support.vision_models import build_tiny_llava, media_reference, save_tiny_llava_checkpoint
from transformers_cb.serve.chat import chat_media as media
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
    model = build_tiny_llava(
        seed=0, image_token=IMAGE_TOKEN, vocab_size=len(tokenizer), max_position_embeddings=512
    )
    model.generation_config = greedy_config(tokenizer)
    return model


def test_an_image_chat_equals_generate_on_the_processors_inputs(monkeypatch) -> None:
    # Imported before the patch below: it binds `load_image` when first imported, and would keep the test's
    # raw-pixel loader for every later test of this process (the Responses test then failed in file order).
    import transformers_cb.serve.responses.response_input  # noqa: F401

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
        assert answer.choices[0].message.content == served_text(tokenizer, tokens)
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


# -- the command's own loading: a checkpoint folder with its processor, real image codecs -------------


def png_bytes(seed: int, size: tuple[int, int] = (40, 50), kind: str = "PNG") -> bytes:
    from PIL import Image

    pixels = (np.random.default_rng(seed).random((*size, 3)) * 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=kind)
    return buffer.getvalue()


def image_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def vlm_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    pytest.importorskip("PIL", reason="decoding images needs Pillow (the serve and test extras)")
    folder = tmp_path_factory.mktemp("tiny-llava")
    model, processor = save_tiny_llava_checkpoint(folder)
    return folder, model, processor


def serve_args(folder: Path) -> argparse.Namespace:
    from transformers_cb.serve.server import add_serve_parser

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    return parser.parse_args(
        ["serve", "--model", str(folder), "--device", "cpu", "--page-size", "16", "--num-blocks", "64"]
    )


@contextmanager
def served_folder(folder: Path) -> Iterator[LiveServer]:
    """`transformers-cb serve --model folder` in this process: `build_state` as the command runs it."""
    from transformers_cb.serve.server import build_state, drain

    state = build_state(serve_args(folder))
    with serving(state, lambda: drain(state.manager, TIMEOUT)) as live:
        yield live


def processor_reference(model: Any, processor: Any, content: list[dict[str, Any]], max_new_tokens: int):
    """`generate()` on what the processor makes of the user turn, the images decoded as the server does."""
    from PIL import Image

    parts = []
    for part in content:
        if part["type"] == "image_url":
            data = base64.b64decode(part["image_url"]["url"].split(",", 1)[1])
            parts.append({"type": "image", "image": Image.open(io.BytesIO(data)).convert("RGB")})
        else:
            parts.append(part)
    rendered = processor.apply_chat_template(
        [{"role": "user", "content": parts}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
    )
    prompt = rendered["input_ids"][0].tolist()
    eos = processor.tokenizer.eos_token_id
    tokens, logprobs = media_reference(
        model, prompt, {"pixel_values": rendered["pixel_values"], "eos_token_id": eos}, max_new_tokens
    )
    return prompt, tokens, logprobs


@requires_serve
def test_the_served_folder_answers_png_and_jpeg_images_as_generate_does(vlm_checkpoint) -> None:
    """The folder's processor is loaded by the command's state building; PNG and JPEG data URLs are decoded
    with Pillow and rendered by it: tokens and logprobs equal `generate()` on the processor's outputs."""
    folder, model, processor = vlm_checkpoint
    with served_folder(folder) as live:
        assert type(live.state.processor).__name__ == "LlavaProcessor"
        client = openai_client(live)
        for seed, mime, kind in ((0, "image/png", "PNG"), (1, "image/jpeg", "JPEG")):
            content = [
                {"type": "text", "text": "what is"},
                image_part(image_url(png_bytes(seed, kind=kind), mime)),
                {"type": "text", "text": "?"},
            ]
            prompt, tokens, logprobs = processor_reference(model, processor, content, 8)
            answer = client.chat.completions.create(
                model=live.state.model_name,
                messages=[{"role": "user", "content": content}],
                max_tokens=8,
                temperature=0,
                logprobs=True,
            )
            assert answer.choices[0].message.content == served_text(processor.tokenizer, tokens)
            assert [t.logprob for t in answer.choices[0].logprobs.content] == pytest.approx(
                logprobs, abs=1e-4
            )
            assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (len(prompt), len(tokens))
        # Text only on the same server: the tokenizer's template, no media.
        text = client.chat.completions.create(
            model=live.state.model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert text.usage.completion_tokens >= 1


@requires_serve
def test_a_corrupt_image_is_a_400_naming_the_field_and_the_server_goes_on(vlm_checkpoint) -> None:
    import httpx

    folder, model, processor = vlm_checkpoint
    good = [{"type": "text", "text": "and"}, image_part(image_url(png_bytes(2)))]
    with served_folder(folder) as live:
        for url, reason in (
            (image_url(b"\x89PNG\r\n\x1a\n not really a png"), "could not be decoded"),
            (image_url(png_bytes(2)[:40]), "could not be decoded"),  # truncated
            ("data:image/png;base64,%%%", "not valid base64"),
        ):
            response = httpx.post(
                live.url + "/v1/chat/completions",
                json={
                    "model": live.state.model_name,
                    "messages": [{"role": "user", "content": [good[0], image_part(url)]}],
                    "max_tokens": 2,
                },
                timeout=TIMEOUT,
            )
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["param"] == "messages.0.content.1.image_url.url" and reason in error["message"]
        assert live.manager.is_running()
        _, tokens, _ = processor_reference(model, processor, good, 4)
        answer = openai_client(live).chat.completions.create(
            model=live.state.model_name,
            messages=[{"role": "user", "content": good}],
            max_tokens=4,
            temperature=0,
        )
        assert answer.choices[0].message.content == served_text(processor.tokenizer, tokens)


@requires_serve
@pytest.mark.slow  # the server in a subprocess
def test_the_serve_command_on_a_vision_language_folder(vlm_checkpoint) -> None:
    """`transformers-cb serve --model folder` itself: the official client's data-URL image is answered as
    `generate()` answers the processor's outputs."""
    from tests.serve.test_command import start_server

    folder, model, processor = vlm_checkpoint
    content = [{"type": "text", "text": "describe"}, image_part(image_url(png_bytes(3)))]
    _, tokens, _ = processor_reference(model, processor, content, 6)
    live = start_server(["--model", str(folder), "--served-model-name", "tiny-llava"])
    try:
        client = openai_client(live)
        answer = client.chat.completions.create(
            model="tiny-llava", messages=[{"role": "user", "content": content}], max_tokens=6, temperature=0
        )
        assert answer.choices[0].message.content == served_text(processor.tokenizer, tokens)
    finally:
        assert live.stop() == 0


@requires_serve
def test_responses_input_images_take_the_same_path(vlm_checkpoint) -> None:
    """`/v1/responses` with `input_image` parts (serve/responses/response_input.py): the chat path's processor and
    engine, so the answer equals `generate()` on the processor's outputs; a bad image names its input field."""
    import httpx

    folder, model, processor = vlm_checkpoint
    url = image_url(png_bytes(4))
    chat_content = [{"type": "text", "text": "look:"}, image_part(url)]
    _, tokens, _ = processor_reference(model, processor, chat_content, 6)
    content = [
        {"type": "input_text", "text": "look:"},
        {"type": "input_image", "image_url": url, "detail": "auto"},
    ]
    with served_folder(folder) as live:
        response = openai_client(live).responses.create(
            model=live.state.model_name,
            input=[{"role": "user", "content": content}],
            max_output_tokens=6,
            temperature=0,
        )
        assert response.output_text == served_text(processor.tokenizer, tokens)
        for part, param, reason in (
            (
                {"type": "input_image", "image_url": image_url(b"not an image")},
                "input.0.content.1.image_url",
                "could not be decoded",
            ),
            (
                {"type": "input_image", "image_url": "https://example.com/cat.png"},
                "input.0.content.1.image_url",
                "only data URLs are read",
            ),
            (
                {"type": "input_image", "file_id": "file-123"},
                "input.0.content.1.image_url",
                "file_id is not read",
            ),
        ):
            reply = httpx.post(
                live.url + "/v1/responses",
                json={
                    "model": live.state.model_name,
                    "input": [{"role": "user", "content": [content[0], part]}],
                },
                timeout=TIMEOUT,
            )
            assert reply.status_code == 400, reply.text
            error = reply.json()["error"]
            assert error["param"] == param and reason in error["message"], error
        assert live.manager.is_running()
