"""A request's media and the store of their encoded rows (docs/multimodal.md).

`RequestMedia` is what a submission's images / videos / audio become (engine/intake/media_inputs.py): the
processor's tensors per modality, kept as given until the encoder runs, and the prompt positions of
each modality's placeholder tokens. The encoder (runner/media/media_runner.py) turns them into one embedding row
per placeholder, kept in the `MediaStore` under the request's id until the prefill chunk that reads
the last placeholder has run; the scheduler's `MediaBudget` (scheduler/media_budget.py) decides, on
the same rows, when a request may hold them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

# The encoder methods of a composite model, by modality: `base_model.get_<modality>_features`.
MODALITIES = ("image", "video", "audio")


@dataclass(eq=False)
class RequestMedia:
    """`inputs[modality]`: the keyword arguments of that modality's feature method (`pixel_values`,
    `image_sizes`, `image_grid_thw`, ...); `placeholders[modality]`: the prompt positions its rows fill,
    ascending; `digest`: the content hash of every tensor (prefix keys); `positions`: a model with
    3-D rotary positions (M-RoPE): the prompt's `[3, L]` positions and the delta generated tokens carry;
    `blocks`: prompt spans `[start, end)` whose tokens attend to each other both ways in the prefill
    (Gemma 3's images, from its `token_type_ids`): runner/packing.py widens their masks, the scheduler
    never ends a chunk inside one."""

    inputs: dict[str, dict[str, torch.Tensor]]
    placeholders: dict[str, list[int]]
    digest: bytes
    positions: torch.Tensor | None = None
    rope_delta: int = 0
    blocks: tuple[tuple[int, int], ...] = ()
    first: int = field(init=False)
    end: int = field(init=False)

    def __post_init__(self) -> None:
        spots = [p for positions in self.placeholders.values() for p in positions]
        self.first = min(spots, default=0)
        self.end = max(spots, default=-1) + 1

    @property
    def num_rows(self) -> int:
        """Embedding rows this request holds in the store while it prefills its media."""
        return sum(len(positions) for positions in self.placeholders.values())

    def page_salt(self, start: int, end: int) -> bytes:
        """What a page covering prompt positions [start, end) adds to its key: the media digest when the
        page holds a placeholder or follows one (its key chains from those), nothing before the first."""
        return self.digest if end > self.first and self.num_rows else b""


def media_digest(inputs: dict[str, dict[str, torch.Tensor]]) -> bytes:
    """A content hash of every tensor (name, dtype, shape, bytes): equal media, equal digest."""
    digest = hashlib.blake2b(digest_size=16)
    for modality in sorted(inputs):
        for name in sorted(inputs[modality]):
            tensor = inputs[modality][name].detach().cpu().contiguous()
            digest.update(f"{modality}.{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
            digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.digest()


@dataclass
class EncodedMedia:
    """One request's encoder output per modality: `rows[modality]` `[placeholders, hidden]`, in the
    order of its placeholders; `extra[modality]`: per-layer rows of the same placeholders a model feeds
    to its decoder besides (Qwen3-VL's deepstack features)."""

    rows: dict[str, torch.Tensor] = field(default_factory=dict)
    extra: dict[str, list[torch.Tensor]] = field(default_factory=dict)

    @property
    def num_bytes(self) -> int:
        tensors = [*self.rows.values(), *(t for layers in self.extra.values() for t in layers)]
        return sum(t.numel() * t.element_size() for t in tensors)


class MediaStore:
    """Encoded rows by request id. It holds exactly the requests the scheduler's `MediaBudget` holds:
    put when the plan says encode, dropped once the last placeholder was read or the request stopped."""

    def __init__(self) -> None:
        self._held: dict[str, EncodedMedia] = {}

    def put(self, request_id: str, encoded: EncodedMedia) -> None:
        self._held[request_id] = encoded

    def get(self, request_id: str) -> EncodedMedia | None:
        return self._held.get(request_id)

    def drop(self, request_id: str) -> None:
        self._held.pop(request_id, None)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._held

    def __len__(self) -> int:
        return len(self._held)

    @property
    def num_bytes(self) -> int:
        return sum(encoded.num_bytes for encoded in self._held.values())
