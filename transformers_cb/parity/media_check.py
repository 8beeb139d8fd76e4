"""The conformance check with images: `generate_batch` against `generate()` on a vision-language model given
the same processor outputs (docs/multimodal.md).

    python -m transformers_cb.conformance_check --model DIR --image cat.png [--image dog.png] [--processor DIR]
    python -m transformers_cb.conformance_check --model DIR --inputs inputs.pt

With `--image`, the model's processor (`--processor`, default the model's folder) renders one user turn per
prompt through its chat template: the images (read with Pillow), one per prompt in turn, and the prompt
text; every other prompt is text only, so that a batch mixes both. With `--inputs`, the prompts are a
`torch.save`d list of processor outputs (dicts with `input_ids` and the processor's tensors), one per
prompt, as `processor(...)` returns them. Each prompt's reference is `generate()` on its inputs alone; the
settings are the text check's (chunked prefill, large pages, eviction, prompt lookup).
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from transformers import GenerationConfig, PreTrainedModel

from ..config.continuous_batching import ContinuousBatchingConfig
from ..requests import RequestStatus
from .compare import greedy_config, plain_generation_config

if TYPE_CHECKING:
    from .batch_runs import SettingResult

# Words of the prompts' text (the check draws them, as the text check draws token ids).
WORDS = ("describe", "the", "image", "what", "colour", "is", "it", "count", "shapes", "briefly", "and", "why")


def load_inputs(path: str | Path) -> list[dict[str, Any]]:
    """A `torch.save`d list of processor outputs (one dict per prompt, `input_ids` first among its keys)."""
    loaded = torch.load(path, weights_only=False)
    if not isinstance(loaded, list) or not all(
        hasattr(item, "keys") and "input_ids" in item for item in loaded
    ):
        raise ValueError(f"{path}: expected a list of processor outputs (dicts with input_ids)")
    return [dict(item) for item in loaded]


def processor_inputs(
    processor: Any, image_paths: Sequence[str], count: int, seed: int
) -> list[dict[str, Any]]:
    """`count` prompts through `processor`'s chat template: even ones with the next image, odd ones text only."""
    try:
        from PIL import Image
    except ImportError as error:
        raise SystemExit(
            "--image needs Pillow to read the images (pip install pillow), or pass --inputs"
        ) from error
    images = [Image.open(path).convert("RGB") for path in image_paths]
    rng = random.Random(seed)
    inputs = []
    for i in range(count):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 12)))
        content: list[dict[str, object]] = [{"type": "text", "text": text}]
        if i % 2 == 0:
            content.insert(0, {"type": "image", "image": images[(i // 2) % len(images)]})
        rendered = processor.apply_chat_template(
            [{"role": "user", "content": content}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
        )
        inputs.append({key: value for key, value in rendered.items() if key != "attention_mask"})
    return inputs


@torch.inference_mode()
def media_reference(model: PreTrainedModel, item: dict[str, Any], config: GenerationConfig) -> list[int]:
    """Greedy tokens of `generate()` on one prompt's processor outputs alone."""
    ids = item["input_ids"]
    ids = ids if ids.dim() == 2 else ids[None]
    extra = {key: value for key, value in item.items() if key != "input_ids"}
    output = cast(Any, model).generate(
        ids.to(model.device),
        attention_mask=torch.ones_like(ids).to(model.device),
        generation_config=config,
        **{key: value.to(model.device) if hasattr(value, "to") else value for key, value in extra.items()},
    )
    return output[0, ids.shape[1] :].tolist()


def run_media_check(
    model: PreTrainedModel,
    inputs: list[dict[str, object]],
    max_new_tokens: int,
    settings: list[tuple[str, dict]],
    eos_token_id: int | list[int] | None = None,
) -> list[SettingResult]:
    """`SettingResult`s (parity/check.py) of each setting against the references; greedy tokens must be
    equal (no near-tie allowance: the near-tie test re-runs the text alone, which a prompt with images is not)."""
    from .batch_runs import GENERATE_KWARGS, SettingResult, generate_batch_counting_preemptions

    config = greedy_config(max_new_tokens, eos_token_id)
    results = []
    with plain_generation_config(model, eos_token_id):
        references = [media_reference(model, item, config) for item in inputs]
        for name, kwargs in settings:
            details: list[str] = []
            result = SettingResult(name, num_requests=len(inputs), details=details)
            extra = {key: value for key, value in kwargs.items() if key in GENERATE_KWARGS}
            cb_kwargs = {key: value for key, value in kwargs.items() if key not in GENERATE_KWARGS}
            start = time.perf_counter()
            outputs, result.num_preemptions = generate_batch_counting_preemptions(
                model, cast(Any, inputs), config, ContinuousBatchingConfig(**cb_kwargs), **extra
            )
            result.seconds = time.perf_counter() - start
            for i, expected in enumerate(references):
                output = outputs.get(f"req_{i}")
                if output is None or output.status != RequestStatus.FINISHED:
                    result.num_failed += 1
                    status = "missing" if output is None else f"{output.status.name}: {output.error}"
                    details.append(f"req_{i}: did not finish ({status})")
                elif output.generated_tokens == expected:
                    result.num_match += 1
                else:
                    result.num_failed += 1
                    details.append(f"req_{i}: {output.generated_tokens} vs generate()'s {expected}")
            results.append(result)
    return results
