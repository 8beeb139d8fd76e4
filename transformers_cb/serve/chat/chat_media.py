"""Images and audio in chat messages: OpenAI's `image_url` and `input_audio` content parts through the
model's processor and its chat template (docs/multimodal.md).

Only data URLs are read (`data:image/png;base64,...`): the server fetches nothing from the network, so a
remote URL is a 400 that says so. A request carries at most `MAX_MEDIA_ITEMS` items of at most
`MAX_MEDIA_BYTES` decoded bytes in all (a 400 past either). Images are decoded with Pillow (a 400 naming
it when it is not installed), `wav` audio with the standard library. The messages, with the decoded
items in their places, go through `processor.apply_chat_template`; its token ids are the prompt and its
other tensors (`pixel_values`, `image_sizes`, ...) the request's media, which the engine checks against
the prompt's placeholders like any other submission's.
"""

from __future__ import annotations

import base64
import binascii
import io
import wave
from typing import Any

import numpy as np

from ..protocol import ApiError, AudioPart, ChatCompletionRequest, ImagePart, TextPart

MAX_MEDIA_ITEMS = 8
MAX_MEDIA_BYTES = 20 * 1024 * 1024
# Processor outputs that are not media: the prompt itself and its mask (the engine attends causally).
NOT_MEDIA = ("input_ids", "attention_mask")


def has_media(body: ChatCompletionRequest) -> bool:
    return any(message.has_media for message in body.messages)


def decode_data_url(url: str, field: str) -> tuple[str, bytes]:
    """The MIME type and bytes of a `data:<type>;base64,<payload>` URL; a 400 naming `field` otherwise."""
    if not url.startswith("data:"):
        raise ApiError(
            400,
            f"{field}: only data URLs are read (data:image/png;base64,...); the server fetches no remote URL",
            param=field,
        )
    header, sep, payload = url[len("data:") :].partition(",")
    if not sep or not header.endswith(";base64"):
        raise ApiError(400, f"{field}: expected data:<type>;base64,<data>", param=field)
    return header[: -len(";base64")], _b64decode(payload, field)


def _b64decode(payload: str, field: str) -> bytes:
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, f"{field}: the data is not valid base64", param=field) from None


def load_image(data: bytes, field: str) -> object:
    """A decoded image (RGB) as the processors take it."""
    try:
        from PIL import Image
    except ImportError:
        raise ApiError(
            400, f"{field}: decoding images needs Pillow, which this server does not have", param=field
        ) from None
    try:
        return Image.open(io.BytesIO(data)).convert("RGB")
    except Exception as error:  # noqa: BLE001 - any decoder failure is the client's data
        raise ApiError(400, f"{field}: the image could not be decoded: {error}", param=field) from None


def load_wav(data: bytes, field: str) -> np.ndarray:
    """A `wav` clip as float32 samples in [-1, 1], channels averaged."""
    try:
        with wave.open(io.BytesIO(data)) as clip:
            width, channels, frames = (
                clip.getsampwidth(),
                clip.getnchannels(),
                clip.readframes(clip.getnframes()),
            )
    except (wave.Error, EOFError) as error:
        raise ApiError(400, f"{field}: not a wav file: {error}", param=field) from None
    kinds = {1: (np.uint8, 128.0, 128.0), 2: (np.int16, 0.0, 32768.0), 4: (np.int32, 0.0, 2147483648.0)}
    if width not in kinds:
        raise ApiError(400, f"{field}: {8 * width}-bit wav samples are not supported", param=field)
    dtype, offset, scale = kinds[width]
    samples = (np.frombuffer(frames, dtype=dtype).astype(np.float32) - offset) / scale
    return samples.reshape(-1, channels).mean(axis=1)


def processor_messages(body: ChatCompletionRequest) -> list[dict[str, object]]:
    """The messages as processors' chat templates take them: content lists of `{"type": "text"}`,
    `{"type": "image", "image": ...}` and `{"type": "audio", "audio": ...}` parts, items decoded and
    bounded (count and bytes)."""
    count, size = 0, 0
    messages: list[dict[str, object]] = []
    for i, message in enumerate(body.messages):
        role = "system" if message.role == "developer" else message.role
        if not isinstance(message.content, list):
            messages.append({"role": role, "content": [{"type": "text", "text": message.text()}]})
            continue
        parts: list[dict[str, object]] = []
        for j, part in enumerate(message.content):
            field = f"messages.{i}.content.{j}"
            if isinstance(part, TextPart):
                parts.append({"type": "text", "text": part.text})
                continue
            count += 1
            if count > MAX_MEDIA_ITEMS:
                raise ApiError(
                    400, f"{field}: at most {MAX_MEDIA_ITEMS} images and audio clips per request", param=field
                )
            if isinstance(part, ImagePart):
                _, data = decode_data_url(part.image_url.url, f"{field}.image_url.url")
            elif isinstance(part, AudioPart):
                if part.input_audio.format != "wav":
                    raise ApiError(
                        400,
                        f"{field}.input_audio.format: only wav audio is decoded",
                        param=f"{field}.input_audio.format",
                    )
                data = _b64decode(part.input_audio.data, f"{field}.input_audio.data")
            size += len(data)
            if size > MAX_MEDIA_BYTES:
                raise ApiError(
                    400, f"{field}: the request's media exceed {MAX_MEDIA_BYTES} bytes in all", param=field
                )
            if isinstance(part, ImagePart):
                parts.append({"type": "image", "image": load_image(data, f"{field}.image_url.url")})
            else:
                parts.append({"type": "audio", "audio": load_wav(data, f"{field}.input_audio.data")})
        messages.append({"role": role, "content": parts})
    return messages


def media_prompt(
    processor: Any, body: ChatCompletionRequest, template_kwargs: dict[str, object]
) -> tuple[list[int], dict[str, object]]:
    """The prompt's token ids and its media (the processor's other tensors) for a chat request with
    images or audio; a 400 when the server has no processor or the processor refuses the messages."""
    if processor is None:
        raise ApiError(
            400,
            "messages: images and audio need the model's processor; this server has none (a model that takes "
            "no media, or a folder without a processor config)",
            param="messages",
        )
    messages = processor_messages(body)
    try:
        rendered = processor.apply_chat_template(
            messages,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
            **template_kwargs,
        )
    except ApiError:
        raise
    except Exception as error:  # noqa: BLE001 - the processor's own checks are about the client's input
        raise ApiError(
            400, f"messages: the model's processor rejected them: {error}", param="messages"
        ) from None
    ids = rendered["input_ids"]
    prompt = [int(t) for t in (ids[0] if getattr(ids, "dim", lambda: 1)() == 2 else ids)]
    media = {name: value for name, value in rendered.items() if name not in NOT_MEDIA}
    return prompt, media
