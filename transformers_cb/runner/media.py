"""Media in the packed step: each request's images / videos / audio encoded once, off the decoder's
step, and their rows scattered into `inputs_embeds` at the placeholders of each prefill chunk
(docs/multimodal.md).

The encoder is the model's own feature path, as `generate()` calls it
(`base_model.get_<modality>_features(**inputs, return_dict=True)`): its pooled output flattened to one
row per placeholder token and kept in the `MediaStore` (memory/media_store.py) until the chunk that
reads the last placeholder has run. A step's `inputs_embeds` are the model's own input embeddings of
the packed tokens with, at each prompt placeholder of a prefill chunk, the next rows of its request
(row = the placeholder's rank in the prompt), so an image may straddle chunks. Generated tokens that
happen to equal a placeholder id are never filled: only prompt positions are. A model with 3-D
rotary positions (M-RoPE) gets its prompt's positions from its own `get_rope_index` and, for
generated tokens, the position plus the rope delta on all three axes, as `generate()` carries it.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel

from ..memory.media_store import EncodedMedia, MediaStore, RequestMedia
from ..requests import Request
from ..scheduler.plan import ScheduledRequest


@dataclass
class MediaStepInputs:
    """What a step with media hands the forward instead of its token ids and 1-D positions."""

    inputs_embeds: torch.Tensor | None = None  # [1, T, hidden]
    position_ids: torch.Tensor | None = None  # [3, 1, T] (M-RoPE)


@dataclass
class MediaRunner:
    """The encoder and the embedding store of one engine. `encode_seconds`: time spent encoding."""

    model: PreTrainedModel
    store: MediaStore = field(default_factory=MediaStore)
    mrope: bool = False
    encode_seconds: float = 0.0
    items_encoded: int = 0

    def encode(self, requests: list[Request]) -> dict[str, str]:
        """Encode each request's media into the store; returns `{request id: why}` for those whose media
        the encoder refused or whose rows do not match their placeholders (only they fail)."""
        failures: dict[str, str] = {}
        start = time.perf_counter()
        base = getattr(self.model, "base_model", self.model)
        for request in requests:
            media = _media_of(request)
            encoded = EncodedMedia()
            try:
                for modality, inputs in media.inputs.items():
                    output = getattr(base, f"get_{modality}_features")(
                        **{name: t.to(self.model.device) for name, t in inputs.items()}, return_dict=True
                    )
                    rows, extra = _flatten(output)
                    if extra:
                        raise ValueError(
                            f"{type(self.model).__name__} feeds per-layer (deepstack) {modality} features to its "
                            "decoder, which continuous batching does not carry yet"
                        )
                    expected = len(media.placeholders[modality])
                    if rows.shape[0] != expected:
                        raise ValueError(
                            f"the {modality} encoder gave {rows.shape[0]} rows for {expected} placeholder tokens"
                        )
                    encoded.rows[modality] = rows
                    self.items_encoded += 1
            except Exception as error:  # noqa: BLE001 - one request's bad media fail that request only
                failures[request.request_id] = (
                    f"its media could not be encoded: {type(error).__name__}: {error}"
                )
                continue
            self.store.put(request.request_id, encoded)
        self.encode_seconds += time.perf_counter() - start
        return failures

    def step_inputs(self, entries: list[ScheduledRequest], input_ids: torch.Tensor) -> MediaStepInputs:
        """The step's embeddings when a prefill chunk reads placeholders, and its 3-D positions when a
        request has them (nothing for a text-only step)."""
        inputs = MediaStepInputs()
        fills: list[tuple[torch.Tensor, torch.Tensor]] = []  # (packed rows, their embedding rows)
        offset = 0
        for entry in entries:
            media = entry.request.media
            if isinstance(media, RequestMedia) and entry.start < media.end:
                encoded = self.store.get(entry.request.request_id)
                if encoded is not None:
                    fills.extend(_chunk_fills(media, encoded, entry, offset))
            offset += entry.num_tokens
        if fills:
            embeds = self.model.get_input_embeddings()(input_ids)  # [1, T, hidden]
            embeds = embeds.clone()
            for index, rows in fills:
                embeds[0, index.to(embeds.device)] = rows.to(embeds.dtype)
            inputs.inputs_embeds = embeds
        if self.mrope and any(isinstance(e.request.media, RequestMedia) for e in entries):
            inputs.position_ids = _mrope_positions(entries, input_ids.device)
        return inputs

    def after_step(self, entries: list[ScheduledRequest]) -> None:
        """Drop the rows of requests whose last placeholder this step read (`MediaBudget.computed`)."""
        for entry in entries:
            media = entry.request.media
            if media is not None and entry.end >= media.end:
                self.store.drop(entry.request.request_id)

    def release(self, request: Request) -> None:
        self.store.drop(request.request_id)


def _media_of(request: Request) -> RequestMedia:
    media = request.media
    if not isinstance(media, RequestMedia):
        raise TypeError(f"{request.request_id}: media of type {type(media).__name__}")
    return media


def _flatten(output: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The pooled features as `[rows, hidden]` (a list of per-item tensors or one batched tensor, as
    `generate()`'s chunked prefill reads them), and the deepstack layers' the same way."""

    def rows_of(features: Any) -> torch.Tensor:
        if isinstance(features, torch.Tensor):
            return features.reshape(-1, features.shape[-1])
        return torch.cat([f.reshape(-1, f.shape[-1]) for f in features])

    pooled = output["pooler_output"] if not isinstance(output, (torch.Tensor, list, tuple)) else output
    deepstack = output.get("deepstack_features") if hasattr(output, "get") else None
    extra = [rows_of(layer) for layer in deepstack] if deepstack is not None else []
    return rows_of(pooled), extra


def _chunk_fills(
    media: RequestMedia, encoded: EncodedMedia, entry: ScheduledRequest, offset: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The packed rows of `entry`'s chunk that are placeholders, each with its embedding row."""
    fills = []
    for modality, spots in media.placeholders.items():
        first = bisect_left(spots, entry.start)
        last = bisect_left(spots, min(entry.end, media.end))
        if first == last:
            continue
        index = torch.tensor([offset + spots[i] - entry.start for i in range(first, last)], dtype=torch.long)
        fills.append((index, encoded.rows[modality][first:last]))
    return fills


def _mrope_positions(entries: list[ScheduledRequest], device: torch.device) -> torch.Tensor:
    """`[3, 1, T]` positions of the packed step: a media request's prompt positions from its rope index,
    past the prompt its position plus the rope delta; any other request's position on all three axes."""
    parts = []
    for entry in entries:
        media = entry.request.media
        positions = torch.arange(entry.start, entry.end, dtype=torch.long)
        if isinstance(media, RequestMedia) and media.positions is not None:
            prompt = media.positions.shape[1]
            inside = positions[positions < prompt]
            outside = positions[positions >= prompt] + media.rope_delta
            part = torch.cat([media.positions[:, inside], outside.expand(3, -1)], dim=1)
        else:
            part = positions.expand(3, -1)
        parts.append(part)
    return torch.cat(parts, dim=1).unsqueeze(1).to(device)
