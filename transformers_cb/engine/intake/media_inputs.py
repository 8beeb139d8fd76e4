"""A submission's images / videos / audio: which keyword arguments are media, checked against the
model's placeholders and made a `RequestMedia` (docs/multimodal.md).

What a model takes is read once from the model itself (`MediaIntake.of`): its feature methods
(`get_image_features`, `get_video_features`, `get_audio_features` on the base model, as `generate()`
finds them), each one's keyword arguments, the placeholder token id of each modality in its config,
and whether its positions are 3-D (M-RoPE: the model's own `get_rope_index`). Every rule a family
needs lives here, keyed by what the model declares, or is a refusal naming the reason.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PretrainedConfig, PreTrainedModel

from ...memory.media_store import MODALITIES, RequestMedia, media_digest

# Names that are media whatever the model: refused by name when the model does not take them.
MEDIA_PREFIXES = ("pixel_values", "image", "video", "audio", "input_features", "vision")
# Processor outputs that are not encoder inputs but say where the media sit: read here, never passed on.
POSITION_KWARGS = ("mm_token_type_ids", "token_type_ids", "attention_mask")
# M-RoPE's modality codes in `mm_token_type_ids` (Qwen2-VL's processors: text 0, image 1, video 2).
MROPE_TYPE = {"image": 1, "video": 2}


@dataclass(frozen=True)
class MediaIntake:
    """What a composite model takes: `params[modality]` its feature method's keyword arguments,
    `token_ids[modality]` its placeholder token; `rope_index`: the model's `get_rope_index` (3-D
    positions), None for 1-D positions; `refusal`: why its media cannot run here (None: they can);
    `blockwise`: given `token_type_ids`, each run of 1s is a block attending both ways (Gemma 3)."""

    model_type: str
    params: dict[str, frozenset[str]] = field(default_factory=dict)
    token_ids: dict[str, int] = field(default_factory=dict)
    rope_index: Callable[..., Any] | None = None
    refusal: str | None = None
    blockwise: bool = False  # each image block of `token_type_ids` attends both ways (Gemma 3)

    @classmethod
    def of(cls, model: PreTrainedModel) -> MediaIntake:
        config = model.config
        model_type = str(getattr(config, "model_type", type(model).__name__))
        base = getattr(model, "base_model", model)
        params: dict[str, frozenset[str]] = {}
        token_ids: dict[str, int] = {}
        for modality in MODALITIES:
            method = getattr(base, f"get_{modality}_features", None)
            token = _token_id(config, modality)
            if method is None or token is None:
                continue
            names = inspect.signature(method).parameters
            params[modality] = frozenset(n for n in names if n not in ("self", "kwargs", "return_dict"))
            token_ids[modality] = token
        refusal = None
        # A composite forward that takes `token_type_ids` builds its prefill mask from them (Gemma 3, Gemma 3n,
        # PaliGemma: the only ones of transformers 5.23 that do), at inference too: generate()'s first
        # forward ORs a blockwise overlay into the causal mask (ANDed with the window on sliding layers).
        # Gemma 3's blocks are each image's run of placeholders (its module's `get_block_sequence_ids_for_mask`):
        # exact here (`RequestMedia.blocks`); PaliGemma's block is the whole prompt prefix, Gemma 3n's its own.
        blockwise = False
        if params and "token_type_ids" in inspect.signature(model.forward).parameters:
            module = inspect.getmodule(type(model))
            blockwise = callable(getattr(module, "get_block_sequence_ids_for_mask", None))
            if not blockwise:
                refusal = (
                    f"{model_type}'s image tokens attend bidirectionally: generate()'s prefill mask, built from "
                    "token_type_ids, lets the whole prompt prefix (PaliGemma) or the media tokens see each "
                    "other both ways, which the paged kernels (causal) do not express; its text path runs"
                )
        # Gemma 4 with `use_bidirectional_attention == "vision"` builds its blocks from `mm_token_type_ids`
        # (image and video runs) and widens only its sliding layers' masks: not the rule above (every layer,
        # `token_type_ids`), so its media are refused rather than run causally (the support check refuses such
        # a model whole today; this holds should it run).
        vision_blocks = getattr(config.get_text_config(), "use_bidirectional_attention", None) == "vision"
        if params and refusal is None and not blockwise and vision_blocks:
            refusal = (
                f"{model_type}'s vision tokens attend to their run both ways on its sliding layers "
                "(use_bidirectional_attention='vision', runs from mm_token_type_ids), which the engine's block "
                "rule (token_type_ids, every layer) does not express"
            )
        rope_index = getattr(base, "get_rope_index", None)
        return cls(
            model_type, params, token_ids, rope_index if callable(rope_index) else None, refusal, blockwise
        )

    @property
    def takes_media(self) -> bool:
        return bool(self.params)

    def is_media(self, name: str) -> bool:
        return (
            name.startswith(MEDIA_PREFIXES)
            or (self.takes_media and name in POSITION_KWARGS)
            or any(name in names for names in self.params.values())
        )

    def on_backend(self, attn_implementation: str) -> MediaIntake:
        """This intake under the run's paged backend: a flash one (causal varlen) cannot widen a prefill
        chunk's mask to an image block, so a blockwise model's media are refused there."""
        if not self.blockwise or self.refusal is not None or "flash" not in attn_implementation:
            return self
        reason = (
            f"{self.model_type}'s image tokens attend to their whole image both ways (token_type_ids), which "
            f"the paged torch backends express and {attn_implementation} (causal varlen) does not; use paged|sdpa"
        )
        return dataclasses.replace(self, refusal=reason)

    def refuse_text_only(self, names: Mapping[str, object]) -> str:
        return (
            f"{sorted(names)}: image, video and audio inputs need a model with feature methods "
            f"(get_image_features, ...); {self.model_type} has none, so only its text path runs"
        )

    def split(self, kwargs: Mapping[str, object] | None) -> tuple[dict[str, object], dict[str, Any]]:
        """`kwargs` as (media, the rest); a value of None is "not given" and dropped from the media."""
        media: dict[str, object] = {}
        rest: dict[str, Any] = {}
        for name, value in (kwargs or {}).items():
            if self.is_media(name):
                if value is not None:
                    media[name] = value
            else:
                rest[name] = value
        return media, rest

    def build(self, prompt: list[int], kwargs: dict[str, object], label: str) -> RequestMedia | None:
        """The request's media from its keyword arguments, checked (every error a `ValueError` naming
        `label` and the argument); None for a text-only prompt without media arguments."""
        placeholders = {
            modality: [i for i, token in enumerate(prompt) if token == token_id]
            for modality, token_id in self.token_ids.items()
        }
        given = {name: value for name, value in kwargs.items() if name not in POSITION_KWARGS}
        if not given:
            for modality, spots in placeholders.items():
                if spots:
                    raise ValueError(
                        f"{label}: the prompt holds {len(spots)} {modality} placeholder tokens (id "
                        f"{self.token_ids[modality]}) but no {modality} input was given"
                    )
            return None
        if self.refusal is not None:
            raise ValueError(f"{label}: {sorted(given)}: {self.refusal}")
        if not self.takes_media:
            raise ValueError(f"{label}: {self.refuse_text_only(given)}")
        inputs: dict[str, dict[str, torch.Tensor]] = {}
        for name, value in given.items():
            owner = next((m for m, names in self.params.items() if name in names), None)
            if owner is None:
                raise ValueError(
                    f"{label}: {name!r} is not an input of {self.model_type}'s feature methods "
                    f"({', '.join(f'get_{m}_features' for m in self.params)})"
                )
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"{label}: {name} must be a tensor, got {type(value).__name__}")
            inputs.setdefault(owner, {})[name] = value
        for modality, tensors in inputs.items():
            spots = placeholders[modality]
            if not spots:
                raise ValueError(
                    f"{label}: {sorted(tensors)} given but the prompt holds no {modality} placeholder token "
                    f"(id {self.token_ids[modality]})"
                )
            _check_counts(modality, tensors, len(spots), label)
        for modality, spots in placeholders.items():
            if spots and modality not in inputs:
                raise ValueError(
                    f"{label}: the prompt holds {len(spots)} {modality} placeholder tokens (id "
                    f"{self.token_ids[modality]}) but no {modality} input was given"
                )
        kept = {m: placeholders[m] for m in inputs}
        positions, delta = self._positions(prompt, inputs, kept, label)
        blocks = self._blocks(kwargs.get("token_type_ids"), len(prompt), label) if self.blockwise else ()
        return RequestMedia(inputs, kept, media_digest(inputs), positions, delta, blocks)

    def _blocks(self, token_type_ids: object, length: int, label: str) -> tuple[tuple[int, int], ...]:
        """The runs of 1s in `token_type_ids` as `[start, end)` spans, as generate()'s prefill mask reads
        them (`get_block_sequence_ids_for_mask`); none without them (generate() is then causal too)."""
        if token_type_ids is None:
            return ()
        if not isinstance(token_type_ids, torch.Tensor) or token_type_ids.numel() != length:
            shape = tuple(token_type_ids.shape) if isinstance(token_type_ids, torch.Tensor) else None
            raise ValueError(
                f"{label}: token_type_ids must hold one value per prompt token ({length}), got "
                f"{shape if shape is not None else type(token_type_ids).__name__}"
            )
        flags = [int(t) == 1 for t in token_type_ids.reshape(-1).tolist()]
        blocks, start = [], None
        for i, flag in enumerate([*flags, False]):
            if flag and start is None:
                start = i
            elif not flag and start is not None:
                blocks.append((start, i))
                start = None
        return tuple(blocks)

    def _positions(
        self,
        prompt: list[int],
        inputs: dict[str, dict[str, torch.Tensor]],
        placeholders: dict[str, list[int]],
        label: str,
    ) -> tuple[torch.Tensor | None, int]:
        """3-D positions of the prompt and the delta of generated tokens, from the model's own
        `get_rope_index` (Qwen2-VL family); (None, 0) for 1-D positions."""
        if self.rope_index is None:
            return None, 0
        ids = torch.tensor([prompt], dtype=torch.long)
        types = torch.zeros_like(ids, dtype=torch.int)
        for modality, spots in placeholders.items():
            types[0, spots] = MROPE_TYPE.get(modality, 0)
        grids = {
            name: t for tensors in inputs.values() for name, t in tensors.items() if name.endswith("grid_thw")
        }
        takes = inspect.signature(self.rope_index).parameters
        if "mm_token_type_ids" in takes:
            grids["mm_token_type_ids"] = types  # Qwen2-VL's family; the Omni thinkers find the spans by token
        if "attention_mask" in takes:
            grids["attention_mask"] = torch.ones_like(ids)
        try:
            positions, deltas = self.rope_index(ids, **grids)
        except Exception as error:  # noqa: BLE001 - the model's own check of the grids against the prompt
            raise ValueError(f"{label}: the media do not match the prompt's placeholders: {error}") from error
        return positions[:, 0].to(torch.long).cpu(), int(deltas.reshape(-1)[0])


def _token_id(config: PretrainedConfig, modality: str) -> int | None:
    for name in (f"{modality}_token_id", f"{modality}_token_index"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def _check_counts(modality: str, tensors: dict[str, torch.Tensor], num_placeholders: int, label: str) -> None:
    """What the shapes alone tell: the grids' patches against the placeholders (merged 2x2 by the
    Qwen-VL family, checked by the model's rope index), and equal item counts across the tensors that
    carry one row per item (`image_sizes`, `*_grid_thw`)."""
    per_item = {name: t.shape[0] for name, t in tensors.items() if name.endswith(("sizes", "grid_thw"))}
    if len(set(per_item.values())) > 1:
        raise ValueError(f"{label}: {modality} inputs disagree on the number of items: {per_item}")
    for name, tensor in tensors.items():
        if tensor.numel() == 0:
            raise ValueError(f"{label}: {name} is empty")
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise ValueError(f"{label}: {name} holds NaN or infinite values")
        uneven = num_placeholders % tensor.shape[0] if tensor.dim() == 4 else 0
        if name.startswith("pixel_values") and uneven and not per_item:
            raise ValueError(
                f"{label}: {num_placeholders} {modality} placeholder tokens do not split evenly over the "
                f"{tensor.shape[0]} items of {name}"
            )
