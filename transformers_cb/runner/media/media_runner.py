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

import dataclasses
import inspect
import time
from bisect import bisect_left
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel

from ...memory.media_store import MODALITIES, EncodedMedia, MediaStore, RequestMedia
from ...requests import Request
from ...scheduler.step_plan import ScheduledRequest


@dataclass
class MediaStepInputs:
    """What a step with media hands the forward instead of its token ids and 1-D positions; `deepstack`:
    the packed rows holding media and, per decoder layer, their rows (Qwen3-VL's deepstack features)."""

    inputs_embeds: torch.Tensor | None = None  # [1, T, hidden]
    position_ids: torch.Tensor | None = None  # [3, 1, T] (M-RoPE)
    deepstack: tuple[torch.Tensor, list[torch.Tensor]] | None = None
    per_layer_inputs: torch.Tensor | None = None  # [1, T, layers, width] (Gemma 4's per-layer embeddings)


class NoMedia:
    """The media of a text-only model: nothing to encode, carry or drop, a step's inputs its token ids
    alone. The runner holds one in place of None (`ModelRunner.media`), so that no step asks whether the
    model takes media."""

    encode_seconds = 0.0
    items_encoded = 0

    def encode(self, requests: list[Request]) -> dict[str, str]:
        return {}

    def step_inputs(self, entries: list[ScheduledRequest], input_ids: torch.Tensor) -> MediaStepInputs:
        return MediaStepInputs()

    def carried(self, inputs: MediaStepInputs) -> AbstractContextManager[None]:
        return nullcontext()

    def after_step(self, entries: list[ScheduledRequest]) -> None:
        return None

    def release(self, request: Request) -> None:
        return None


@dataclass
class MediaRunner:
    """The encoder and the embedding store of one engine. `encode_seconds`: time spent encoding;
    `items_encoded`: images, videos or clips encoded."""

    model: PreTrainedModel
    store: MediaStore = field(default_factory=MediaStore)
    mrope: bool = False
    encode_seconds: float = 0.0
    items_encoded: int = 0

    def encode(self, requests: list[Request]) -> dict[str, str]:
        """Encode each request's media into the store; returns `{request id: why}` for those whose media
        the encoder refused or whose rows do not match their placeholders (only they fail).

        Requests whose tensors of a modality differ only in their leading (item) dimension are encoded in
        one call, their rows split back by placeholder counts; a joined call that fails is retried one
        request at a time, so that only the request at fault fails."""
        failures: dict[str, str] = {}
        start = time.perf_counter()
        encoded = {request.request_id: EncodedMedia() for request in requests}
        for modality in MODALITIES:
            group = [r for r in requests if modality in _media_of(r).inputs]
            for batch in _joinable(group, modality):
                joined = self._encode_joined(batch, modality) if len(batch) > 1 else None
                for request in batch:
                    if request.request_id in failures:
                        continue
                    try:
                        rows, extra = (
                            joined[request.request_id] if joined else self._encode_one(request, modality)
                        )
                    except Exception as error:  # noqa: BLE001 - one request's bad media fail that request only
                        failures[request.request_id] = (
                            f"its media could not be encoded: {type(error).__name__}: {error}"
                        )
                        continue
                    encoded[request.request_id].rows[modality] = rows
                    if extra:
                        encoded[request.request_id].extra[modality] = extra
                    self.items_encoded += _num_items(_media_of(request).inputs[modality])
        for request in requests:
            if request.request_id not in failures:
                self.store.put(request.request_id, encoded[request.request_id])
        self.encode_seconds += time.perf_counter() - start
        return failures

    def _features(
        self, modality: str, inputs: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[int] | None]:
        """The rows, the deepstack layers' rows and, when the model gives one tensor per item, each item's
        row count."""
        base = getattr(self.model, "base_model", self.model)
        output = getattr(base, f"get_{modality}_features")(
            **{name: t.to(self.model.device) for name, t in inputs.items()}, return_dict=True
        )
        rows, extra, item_rows = _flatten(output)
        if extra and self.deepstack_target() is None:
            raise ValueError(
                f"{type(self.model).__name__} gives per-layer (deepstack) {modality} features but its "
                "language model takes no deepstack_visual_embeds"
            )
        return rows, extra, item_rows

    def _encode_one(self, request: Request, modality: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
        media = _media_of(request)
        rows, extra, _ = self._features(modality, media.inputs[modality])
        expected = len(media.placeholders[modality])
        if rows.shape[0] != expected:
            raise ValueError(
                f"the {modality} encoder gave {rows.shape[0]} rows for {expected} placeholder tokens"
            )
        return rows, extra

    def _encode_joined(
        self, batch: list[Request], modality: str
    ) -> dict[str, tuple[torch.Tensor, list[torch.Tensor]]] | None:
        """One encoder call for `batch`, its rows split back by request; None when the call fails or any
        request's items do not give exactly its placeholders' rows (they are then encoded one by one,
        where the fault is named)."""
        names = sorted(_media_of(batch[0]).inputs[modality])
        joined = {name: torch.cat([_media_of(r).inputs[modality][name] for r in batch]) for name in names}
        counts = [len(_media_of(r).placeholders[modality]) for r in batch]
        items = [_num_items(_media_of(r).inputs[modality]) for r in batch]
        try:
            rows, extra, item_rows = self._features(modality, joined)
        except Exception:  # noqa: BLE001 - retried one request at a time, where the fault is named
            return None
        if item_rows is None or len(item_rows) != sum(items):
            return None
        first = 0
        for count, num_items in zip(counts, items, strict=True):
            if sum(item_rows[first : first + num_items]) != count:
                return None
            first += num_items
        split_rows = rows.split(counts)
        split_extra = [layer.split(counts) for layer in extra]
        return {
            request.request_id: (split_rows[i], [layer[i] for layer in split_extra])
            for i, request in enumerate(batch)
        }

    def step_inputs(self, entries: list[ScheduledRequest], input_ids: torch.Tensor) -> MediaStepInputs:
        """The step's embeddings when a prefill chunk reads placeholders, and its 3-D positions when a
        request has them (nothing for a text-only step)."""
        inputs = MediaStepInputs()
        fills: list[tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]] = []  # packed rows, rows, layers'
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
            for index, rows, _ in fills:
                embeds[0, index.to(embeds.device)] = rows.to(embeds.dtype)
            inputs.inputs_embeds = embeds
            inputs.per_layer_inputs = self._per_layer_inputs(input_ids, embeds, fills)
            if any(layers for _, _, layers in fills):
                inputs.deepstack = _deepstack(fills, input_ids.shape[1], embeds.device)
        if self.mrope and any(isinstance(e.request.media, RequestMedia) for e in entries):
            inputs.position_ids = _mrope_positions(entries, input_ids.device)
        return inputs

    def _per_layer_inputs(
        self,
        input_ids: torch.Tensor,
        embeds: torch.Tensor,
        fills: list[tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]],
    ) -> torch.Tensor | None:
        """A model with per-layer token embeddings (Gemma 4) computes them from the token ids with its
        placeholders as the pad token, as its forward does given ids; given embeddings it would have to
        invert them, which media rows make impossible."""
        language_model = getattr(getattr(self.model, "base_model", self.model), "language_model", None)
        text_config = self.model.config.get_text_config()
        method = getattr(language_model, "get_per_layer_inputs", None)
        if not callable(method) or not getattr(text_config, "hidden_size_per_layer_input", None):
            return None
        ids = input_ids.clone()
        ids[0, torch.cat([index for index, _, _ in fills]).to(ids.device)] = int(
            text_config.pad_token_id or 0
        )
        return method(ids, embeds)

    def deepstack_target(self) -> torch.nn.Module | None:
        """The language model that takes `deepstack_visual_embeds` (Qwen3-VL), if the model has one."""
        base = getattr(self.model, "base_model", self.model)
        language_model = getattr(base, "language_model", None)
        if language_model is None:
            return None
        takes = "deepstack_visual_embeds" in inspect.signature(language_model.forward).parameters
        return language_model if takes else None

    @contextmanager
    def carried(self, inputs: MediaStepInputs) -> Iterator[None]:
        """The step's deepstack rows handed to the language model's forward (the composite forward only
        computes them from pixels or pre-encoded outputs, which a packed step cannot give it)."""
        if inputs.per_layer_inputs is not None:
            per_layer = inputs.per_layer_inputs
            base = getattr(self.model, "base_model", self.model)

            def give(
                _module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]
            ) -> tuple[tuple, dict[str, Any]]:
                return args, {**kwargs, "per_layer_inputs": per_layer}

            handle = base.register_forward_pre_hook(give, with_kwargs=True)
            try:
                with self.carried(dataclasses.replace(inputs, per_layer_inputs=None)):
                    yield
            finally:
                handle.remove()
            return
        target = self.deepstack_target() if inputs.deepstack is not None else None
        if target is None or inputs.deepstack is None:
            yield
            return
        mask, layers = inputs.deepstack

        def hook(
            _module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]
        ) -> tuple[tuple, dict[str, Any]]:
            return args, {**kwargs, "visual_pos_masks": mask, "deepstack_visual_embeds": layers}

        handle = target.register_forward_pre_hook(hook, with_kwargs=True)
        try:
            yield
        finally:
            handle.remove()

    def after_step(self, entries: list[ScheduledRequest]) -> None:
        """Drop the rows of requests whose last placeholder this step read (`MediaBudget.computed`)."""
        for entry in entries:
            media = entry.request.media
            if media is not None and entry.end >= media.end:
                self.store.drop(entry.request.request_id)

    def release(self, request: Request) -> None:
        self.store.drop(request.request_id)


def _joinable(requests: list[Request], modality: str) -> list[list[Request]]:
    """`requests` in runs whose tensors of `modality` have the same names, dtypes and shapes past their
    first dimension (they concatenate along it), in order."""
    runs: dict[tuple, list[Request]] = {}
    for request in requests:
        inputs = _media_of(request).inputs[modality]
        key = tuple((name, t.dtype, tuple(t.shape[1:])) for name, t in sorted(inputs.items()))
        runs.setdefault(key, []).append(request)
    return list(runs.values())


def _num_items(inputs: dict[str, torch.Tensor]) -> int:
    """Items (images, videos, clips) in one request's tensors: one row each of `*grid_thw` / `*sizes`
    where given, else the leading dimension of its first tensor."""
    for name, tensor in sorted(inputs.items()):
        if name.endswith(("grid_thw", "sizes")):
            return tensor.shape[0]
    return next(iter(inputs.values())).shape[0]


def _media_of(request: Request) -> RequestMedia:
    media = request.media
    if not isinstance(media, RequestMedia):
        raise TypeError(f"{request.request_id}: media of type {type(media).__name__}")
    return media


def _flatten(output: Any) -> tuple[torch.Tensor, list[torch.Tensor], list[int] | None]:
    """The pooled features as `[rows, hidden]` (a list of per-item tensors or one batched tensor, as
    `generate()`'s chunked prefill reads them), the deepstack layers' the same way, and each item's row
    count when the features come as one tensor per item."""

    def rows_of(features: Any) -> torch.Tensor:
        if isinstance(features, torch.Tensor):
            return features.reshape(-1, features.shape[-1])
        return torch.cat([f.reshape(-1, f.shape[-1]) for f in features])

    pooled = output["pooler_output"] if not isinstance(output, (torch.Tensor, list, tuple)) else output
    deepstack = output.get("deepstack_features") if hasattr(output, "get") else None
    extra = [rows_of(layer) for layer in deepstack] if deepstack is not None else []
    item_rows = None
    if isinstance(pooled, (list, tuple)):
        item_rows = [f.reshape(-1, f.shape[-1]).shape[0] for f in pooled]
    return rows_of(pooled), extra, item_rows


def _chunk_fills(
    media: RequestMedia, encoded: EncodedMedia, entry: ScheduledRequest, offset: int
) -> list[tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]]:
    """The packed rows of `entry`'s chunk that are placeholders, with their embedding rows and their
    rows of each deepstack layer."""
    fills = []
    for modality, spots in media.placeholders.items():
        first = bisect_left(spots, entry.start)
        last = bisect_left(spots, min(entry.end, media.end))
        if first == last:
            continue
        index = torch.tensor([offset + spots[i] - entry.start for i in range(first, last)], dtype=torch.long)
        layers = [layer[first:last] for layer in encoded.extra.get(modality, [])]
        fills.append((index, encoded.rows[modality][first:last], layers))
    return fills


def _deepstack(
    fills: list[tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]], num_tokens: int, device: torch.device
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """`visual_pos_masks` `[1, T]` and each layer's rows in packed order, as Qwen3-VL's forward builds them."""
    index = torch.cat([i for i, _, _ in fills])
    order = index.argsort()
    mask = torch.zeros(1, num_tokens, dtype=torch.bool, device=device)
    mask[0, index.to(device)] = True
    num_layers = max(len(layers) for _, _, layers in fills)
    layers = [
        torch.cat([ls[k] for _, _, ls in fills])[order.to(fills[0][1].device)] for k in range(num_layers)
    ]
    return mask, layers


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
