"""Prefix keys with media (issue 39 item 4): the pages from a prompt's first placeholder on carry its
media's content digest, so two requests with the same image share them and two with different images
at the same placeholder tokens never do."""

from __future__ import annotations

import torch

from tests.kv.test_prefix_cache import PS, drain, request, sharing_scheduler
from transformers_cb.kv.page_keys import request_keys
from transformers_cb.memory.media_store import RequestMedia, media_digest

IMAGE = 7
PROMPT = [1, 2, 3, 4, IMAGE, IMAGE, IMAGE, IMAGE, 5, 6, 7, 8, 9, 10, 11, 12, 13]  # the image on page 1


def media(seed: int) -> RequestMedia:
    inputs = {
        "image": {"pixel_values": torch.randn(1, 3, 4, 4, generator=torch.Generator().manual_seed(seed))}
    }
    return RequestMedia(inputs, {"image": [4, 5, 6, 7]}, media_digest(inputs))


def with_media(request_id: str, seed: int):
    built = request(request_id, PROMPT)
    built.media = media(seed)
    return built


def test_keys_include_the_image_from_its_first_page_on() -> None:
    num_pages = len(PROMPT) // PS
    text, same, again, other = (
        request("t", PROMPT),
        with_media("a", 0),
        with_media("b", 0),
        with_media("c", 1),
    )
    keys = {r.request_id: request_keys(r, num_pages, PS) for r in (text, same, again, other)}
    assert keys["a"] == keys["b"]  # equal media: equal keys
    assert keys["a"][0] == keys["c"][0] == keys["t"][0]  # text before the image: shared
    for i in range(1, num_pages):  # the image's page and every page after it differ
        assert keys["a"][i] != keys["c"][i] and keys["a"][i] != keys["t"][i]


def test_a_different_image_takes_no_cached_page_past_the_text() -> None:
    for seed, expected_hit in ((0, 16), (1, 4)):  # all 4 pages before the last token, or the text
        scheduler = sharing_scheduler(num_pages=32)
        scheduler.add(with_media("first", 0))
        drain(scheduler)
        second = with_media("second", seed)
        scheduler.add(second)
        scheduler.schedule()
        assert second.num_computed_tokens == expected_hit
