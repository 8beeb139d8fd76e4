"""Content keys of pages: a full page's key chained over the whole prefix (`page_key`), the partial key of a
page's first tokens (`partial_key`), a request's root (`root_key`, salted per request where its chain must be
its own) and a request's keys, computed lazily (`request_keys`). Used by prefix_cache.py; docs/prefix_sharing.md.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from ..requests import Request

ROOT_KEY = bytes(16)
# A partial key covers a page's first tokens in multiples of this many (the native kernel's key block).
PARTIAL_STEP = 16
_PARTIAL_TAG = b"partial"

# A page copy: (KV group, source page, destination page), run before the next forward writes anything.
PageCopy = tuple[int, int, int]


def page_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The content key of a full page holding `tokens`, after the page whose key is `parent`."""
    data = parent + struct.pack(f"<{len(tokens)}q", *tokens)
    return hashlib.blake2b(data, digest_size=16).digest()


def partial_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The partial key of a page whose first tokens are `tokens` (fewer than a page), after `parent`."""
    return page_key(parent + _PARTIAL_TAG, tokens)


def root_key(salt: bytes = b"") -> bytes:
    """The parent of a request's page 0: `ROOT_KEY`, or a key of its own for a salted request (the chain
    carries it to every page)."""
    return hashlib.blake2b(ROOT_KEY + salt, digest_size=16).digest() if salt else ROOT_KEY


def request_keys(request: Request, num_pages: int, page_size: int, salt: bytes = b"") -> list[bytes]:
    """Keys of the request's first `num_pages` pages (all full), extended lazily and kept on it.

    A request with media salts the key of each page from its first placeholder on with the media's
    content digest (`MediaSpans.page_salt`): the same image shares pages, another image at the same
    placeholder tokens never does (docs/multimodal.md). `salt`: the request's whole chain's (a dynamic
    rotary embedding's frequency set, `RopeRule.prefix_salt`), always the same for one request."""
    keys = request.page_keys
    tokens = request.all_token_ids
    media = request.media
    while len(keys) < num_pages:
        i = len(keys)
        parent = keys[-1] if keys else root_key(salt)
        media_salt = media.page_salt(i * page_size, (i + 1) * page_size) if media is not None else b""
        keys.append(
            page_key(
                parent + media_salt if media_salt else parent, tokens[i * page_size : (i + 1) * page_size]
            )
        )
    return keys
