"""The media column (`--media`): an image-text-to-text class judged with small random images against
`generate()` given the same processor-shaped inputs (docs/multimodal.md).

Processors cannot be built offline here (their resizing needs Pillow or torchvision), so the inputs are
shaped the way the families' processors shape them, tried in order until the class's own
`get_image_features` takes one: flattened patches with a `[1, h, w]` grid (the Qwen-VL family), patches with
their `image_position_ids` (Gemma 4, pooled k x k), a batch of images, images with their `image_sizes`, tiles with `image_sizes` (LLaVA-NeXT), one prompt's images with
their `pixel_attention_mask` (Idefics). Each image's placeholder count is what the encoder returns for it.
The model is rebuilt from the entry's tiny config with its vision tower's images shrunk to a few patches (a
config whose vision tower is optional and unset, Gemma 4's, gets its class's default vision config, shrunk).

Three prompts in one `generate_batch` (4-token pages, a 5-token step budget so chunks cut the images): one
image, text only, two images. States: exact (tokens equal, logprobs within the matrix's tolerance), refused
(the engine, or the support check, refuses the images up front with the reason), mismatch, crash, not judged (no input shape fits
the class, or `generate()` itself fails on them; with the reason).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers import AutoModelForImageTextToText, GenerationConfig, PreTrainedModel

from transformers_cb import ContinuousBatchingConfig
from transformers_cb.engine.intake.media_inputs import MediaIntake

from .build import SEED, entry_config
from .catalog import Entry
from .judge import LOGPROB_TOLERANCE, first_difference
from .outcome import CRASH, EXACT, MISMATCH, REFUSED, Outcome, one_line
from .shrink import shrink_dict

NOT_JUDGED = "not judged"
MEDIA_STATES = (EXACT, REFUSED, MISMATCH, CRASH, NOT_JUDGED)
MAX_NEW_TOKENS = 6
TEXT = ([21, 22, 23, 24], [25, 26, 27, 28, 29, 30, 31, 32], [33, 34, 35, 36])


def _ints(value: Any) -> tuple[int, int] | None:
    if isinstance(value, int):
        return value, value
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, int) for v in value):
        return int(value[0]), int(value[1])
    return None


def media_model(entry: Entry) -> PreTrainedModel:
    """The entry's class from its tiny config with images of a few patches (4x4, or the merge's multiple)."""
    config = entry_config(entry)
    vision = getattr(config, "vision_config", None)
    vision_class = (getattr(config, "sub_configs", None) or {}).get("vision_config")
    if vision is None and isinstance(vision_class, type):  # Gemma 4: no vision tower unless configured
        vision = config.vision_config = vision_class.from_dict(shrink_dict(vision_class().to_dict()))
    patch = _ints(getattr(vision, "patch_size", None))
    if vision is not None and patch is not None and _ints(getattr(vision, "image_size", None)) is not None:
        size = [4 * patch[0], 4 * patch[1]]
        vision.image_size = size if isinstance(vision.image_size, (list, tuple)) else size[0]
        if getattr(config, "image_grid_pinpoints", None):  # LLaVA-NeXT's tilings, at the new size
            config.image_grid_pinpoints = [size, [size[0], 2 * size[1]]]
        if isinstance(
            getattr(config, "mm_tokens_per_image", None), int
        ):  # Gemma 3: 4x4 patches pooled to 2x2
            config.mm_tokens_per_image = 4
    torch.manual_seed(SEED)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32).eval()
    model.generation_config = GenerationConfig(bos_token_id=None, pad_token_id=0, eos_token_id=None)
    return model


def _candidates(model: PreTrainedModel) -> list[tuple[str, Callable[[int, int], dict[str, torch.Tensor]]]]:
    """Input shapes to try, `(name, make(seed, count))`."""
    vision = getattr(model.config, "vision_config", None)
    channels = getattr(vision, "num_channels", None) or getattr(vision, "in_channels", None) or 3
    patch = _ints(getattr(vision, "patch_size", None)) or (14, 14)
    size = _ints(getattr(vision, "image_size", None)) or (4 * patch[0], 4 * patch[1])

    def randn(seed: int, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))

    shapes: list[tuple[str, Callable[[int, int], dict[str, torch.Tensor]]]] = []
    temporal = getattr(vision, "temporal_patch_size", None)
    merge = getattr(vision, "spatial_merge_size", None) or 1
    if isinstance(temporal, int):
        side = 2 * merge
        shapes.append((
            "patches + image_grid_thw",
            lambda seed, n: {
                "pixel_values": randn(seed, side * side * n, channels * temporal * patch[0] * patch[1]),
                "image_grid_thw": torch.tensor([[1, side, side]] * n),
            },
        ))  # fmt: skip
    pooling = getattr(vision, "pooling_kernel_size", None)
    if isinstance(pooling, int):  # Gemma 4: each image its patches with (x, y) positions, pooled k x k
        side = 2 * pooling
        grid = torch.stack(torch.meshgrid(torch.arange(side), torch.arange(side), indexing="xy"), -1).reshape(
            -1, 2
        )
        shapes.append((
            "patches + image_position_ids",
            lambda seed, n: {
                "pixel_values": torch.rand(
                    n, side * side, channels * patch[0] * patch[1], generator=torch.Generator().manual_seed(seed)
                ),
                "image_position_ids": grid.expand(n, -1, -1).clone(),
            },
        ))  # fmt: skip
    shapes += [
        ("images", lambda seed, n: {"pixel_values": randn(seed, n, channels, *size)}),
        (
            "images + image_sizes",
            lambda seed, n: {
                "pixel_values": randn(seed, n, channels, *size),
                "image_sizes": torch.tensor([list(size)] * n),
            },
        ),
        (
            "tiles + image_sizes",
            lambda seed, n: {
                "pixel_values": randn(seed, n, 3, channels, *size),
                "image_sizes": torch.tensor([[size[0], 2 * size[1]]] * n),
            },
        ),
        (
            "one prompt's images + pixel_attention_mask",
            lambda seed, n: {
                "pixel_values": randn(seed, 1, n, channels, *size),
                "pixel_attention_mask": torch.ones(1, n, *size, dtype=torch.bool),
            },
        ),
    ]
    return shapes


@torch.inference_mode()
def _rows_per_image(
    model: PreTrainedModel, images: dict[str, torch.Tensor], apart: bool = False
) -> list[int]:
    """The placeholder rows of each image (`apart`: one count per image of a `[images, rows, hidden]`
    output, for a model whose images are blocks of their own; else the whole output as one count)."""
    output = model.base_model.get_image_features(**images, return_dict=True)
    pooled = output["pooler_output"]
    if isinstance(pooled, torch.Tensor) and apart and pooled.dim() == 3:
        return [pooled.shape[1]] * pooled.shape[0]
    if isinstance(pooled, torch.Tensor):
        return [pooled.reshape(-1, pooled.shape[-1]).shape[0]]
    return [item.reshape(-1, item.shape[-1]).shape[0] for item in pooled]


def _prompt(model: PreTrainedModel, text: list[int], rows: list[int], token: int) -> list[int]:
    """`text` around each image's placeholders, between its start / end tokens where the config names them
    (the 3-D position families find an image's span by them)."""
    config = model.config
    bracket: tuple[int, int] | None = None
    names = [(f"{prefix}_start_token_id", f"{prefix}_end_token_id") for prefix in ("vision", "image")]
    for first, last in [*names, ("boi_token_index", "eoi_token_index")]:  # Gemma 3: begin / end of image
        start, end = getattr(config, first, None), getattr(config, last, None)
        if isinstance(start, int) and isinstance(end, int):
            bracket = (start, end)
            break
    middle: list[int] = []
    for count in rows:
        middle += [bracket[0], *[token] * count, bracket[1]] if bracket else [token] * count
    return [*text[:2], *middle, *text[2:]]


def _with_types(prompt: list[int], images: dict[str, Any], token: int, blockwise: bool) -> dict[str, Any]:
    """`images` with what a blockwise model's processor adds (Gemma 3's `token_type_ids`, 1 at image
    placeholders: generate() and the engine let each image's run attend both ways)."""
    if not (images and blockwise):
        return images
    return {**images, "token_type_ids": (torch.tensor([prompt]) == token).long()}


@torch.inference_mode()
def _reference(model: PreTrainedModel, prompt: list[int], images: dict[str, Any], token: int, mrope: bool):
    """`generate()`'s tokens and logprobs; a 3-D position model gets the processor's `mm_token_type_ids`
    (1 at image placeholders) where its `generate()` takes them."""
    ids = torch.tensor([prompt])
    extra = dict(images)
    if images and mrope:
        try:
            return _generate(model, prompt, {**extra, "mm_token_type_ids": (ids == token).to(torch.int)})
        except ValueError as exc:
            if "mm_token_type_ids" not in str(exc):
                raise
    return _generate(model, prompt, extra)


def _generate(
    model: PreTrainedModel, prompt: list[int], extra: dict[str, Any]
) -> tuple[list[int], list[float]]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW_TOKENS, do_sample=False, pad_token_id=0,
        output_scores=True, return_dict_in_generate=True, **extra,
    )  # fmt: skip
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [
        torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, tokens, strict=True)
    ]
    return tokens, logprobs


def media_outcome(entry: Entry, model: PreTrainedModel, ours: Outcome) -> Outcome | None:
    """The row's media cell: None for a model without an image encoder, not judged while its text path is
    not exact, else `run_media`."""
    if "image" not in MediaIntake.of(model).token_ids:
        return None
    if ours.state != EXACT:
        return Outcome(NOT_JUDGED, f"its text path is {ours.state}")
    try:
        return run_media(entry)
    except Exception as exc:  # noqa: BLE001 - a failure of the judge is the cell's reason, not the row's
        return Outcome(CRASH, one_line(f"media judge: {type(exc).__name__}: {exc}"))


def run_media(entry: Entry) -> Outcome:
    """The media column's outcome for an image-text-to-text entry."""
    try:
        model = media_model(entry)
    except Exception as exc:  # noqa: BLE001
        return Outcome(NOT_JUDGED, one_line(f"the tiny model with small images cannot be built: {exc}"))
    intake = MediaIntake.of(model)
    if "image" not in intake.token_ids:
        return Outcome(NOT_JUDGED, "no get_image_features with an image token id in the config")
    if intake.refusal is not None:  # refused at submission whatever the inputs
        return Outcome(REFUSED, one_line(intake.refusal))
    token = intake.token_ids["image"]
    failures: list[str] = []
    for name, make in _candidates(model):
        try:
            one, two = make(0, 1), make(1, 2)
            rows_one = _rows_per_image(model, one, intake.blockwise)
            rows_two = _rows_per_image(model, two, intake.blockwise)
        except Exception:  # noqa: BLE001 - this shape does not fit the class: try the next
            continue
        prompts = [
            _prompt(model, TEXT[0], rows_one, token),
            TEXT[1],
            _prompt(model, TEXT[2], rows_two, token),
        ]
        media = [
            _with_types(p, m, token, intake.blockwise) for p, m in zip(prompts, [one, {}, two], strict=True)
        ]
        try:
            references = [
                _reference(model, p, m, token, intake.rope_index is not None)
                for p, m in zip(prompts, media, strict=True)
            ]
        except Exception as exc:  # noqa: BLE001 - generate() refuses these inputs: try the next shape
            failures.append(f"generate() fails on {name}: {type(exc).__name__}: {exc}")
            continue
        return _judge_ours(model, prompts, media, references, name)
    if failures:
        return Outcome(NOT_JUDGED, one_line(failures[0]))
    return Outcome(NOT_JUDGED, "no processor-shaped input fits the class's get_image_features")


def _judge_ours(model, prompts, media, references, shape: str) -> Outcome:
    inputs = [{"input_ids": torch.tensor([p]), **m} for p, m in zip(prompts, media, strict=True)]
    config = ContinuousBatchingConfig(page_size=4, max_batch_tokens=5, return_logprobs=True)
    try:
        results = model.generate_batch(
            inputs, GenerationConfig(max_new_tokens=MAX_NEW_TOKENS, do_sample=False),
            continuous_batching_config=config, progress_bar=False,
        )  # fmt: skip
    except (ValueError, NotImplementedError) as exc:  # refused up front (the support check), with the reason
        return Outcome(REFUSED, one_line(str(exc)))
    except Exception as exc:  # noqa: BLE001
        return Outcome(CRASH, one_line(f"{type(exc).__name__}: {exc}"))
    for i, (tokens, logprobs) in enumerate(references):
        out = results[f"req_{i}"]
        if out.error is not None:
            return Outcome(CRASH, one_line(f"request {i} failed: {out.error}"))
        index = first_difference(tokens, out.generated_tokens)
        if index is not None:
            return Outcome(
                MISMATCH, one_line(f"prompt {i} differs at token {index}: {tokens} vs {out.generated_tokens}")
            )
        for k, (a, b) in enumerate(zip(logprobs, out.logprobs or [], strict=False)):
            if abs(a - b) > LOGPROB_TOLERANCE:
                return Outcome(
                    MISMATCH, f"prompt {i}: the logprob of token {k} is {b:.5f}, generate()'s {a:.5f}"
                )
    return Outcome(EXACT, "", f"inputs: {shape}")
