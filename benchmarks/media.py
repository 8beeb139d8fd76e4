"""Images through continuous batching against `generate()` (issue 39's benchmark row).

    python benchmarks/media.py [--requests 32] [--max-new-tokens 32] [--hidden 256] [--layers 4] [--image-size 56]

A random Llava (a CLIP tower and a Llama decoder of the given size; no download) and `--requests` prompts of
random text around one random image each. Three engines on the same inputs: `generate()` one request at a
time, `generate()` on one left-padded batch (every image in one `pixel_values`), and ours (`generate_batch`);
our encoder time (the feature path, run once per image at admission, off the decoder's forwards) is shown on
its own. Greedy tokens are compared with the one-by-one run. The machine may be noisy: read the ratios of
one run, not absolute numbers across runs (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from transformers import (
    CLIPVisionConfig,
    GenerationConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
)

import transformers_cb  # noqa: F401  (installs the plugin)
from transformers_cb.api.generate_batch import CACHED_ENGINE_ATTR

IMAGE_TOKEN = 3
PAD = 0


def build(hidden: int, layers: int, image_size: int) -> LlavaForConditionalGeneration:
    torch.manual_seed(0)
    vision = CLIPVisionConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        image_size=image_size,
        patch_size=14,
        projection_dim=hidden,
    )
    text = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1024,
        max_position_embeddings=1024,
    )
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN)
    return LlavaForConditionalGeneration(config).eval()


def workload(n: int, image_size: int, seed: int = 0) -> tuple[list[list[int]], list[torch.Tensor]]:
    rng = random.Random(seed)
    placeholders = (image_size // 14) ** 2
    prompts = [
        [*(rng.randrange(10, 1024) for _ in range(rng.randrange(4, 32))), *[IMAGE_TOKEN] * placeholders,
         *(rng.randrange(10, 1024) for _ in range(rng.randrange(4, 32)))]
        for _ in range(n)
    ]  # fmt: skip
    generator = torch.Generator().manual_seed(seed)
    images = [torch.randn(1, 3, image_size, image_size, generator=generator) for _ in range(n)]
    return prompts, images


@torch.inference_mode()
def one_by_one(model, prompts, images, max_new: int) -> tuple[float, list[list[int]]]:
    start, outputs = time.perf_counter(), []
    for prompt, image in zip(prompts, images, strict=True):
        ids = torch.tensor([prompt])
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), pixel_values=image, max_new_tokens=max_new,
            min_new_tokens=max_new, do_sample=False, pad_token_id=PAD,
        )  # fmt: skip
        outputs.append(out[0, len(prompt) :].tolist())
    return time.perf_counter() - start, outputs


@torch.inference_mode()
def padded(model, prompts, images, max_new: int) -> tuple[float, list[list[int]]]:
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    out = model.generate(
        ids, attention_mask=mask, pixel_values=torch.cat(images), max_new_tokens=max_new,
        min_new_tokens=max_new, do_sample=False, pad_token_id=PAD,
    )  # fmt: skip
    return time.perf_counter() - start, [row[width:].tolist() for row in out]


def ours(model, prompts, images, max_new: int) -> tuple[float, list[list[int]], float]:
    config = GenerationConfig(max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False)
    start = time.perf_counter()
    results = model.generate_batch(
        prompts, config, progress_bar=False, pixel_values=images, persistent_manager=True
    )
    elapsed = time.perf_counter() - start
    engine = getattr(model, CACHED_ENGINE_ATTR)[1]
    encode_seconds = engine.snapshot().media_encode_seconds
    model.destroy_cached_continuous_batching_manager()
    return elapsed, [results[f"req_{i}"].generated_tokens for i in range(len(prompts))], encode_seconds


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--image-size", type=int, default=56)
    args = parser.parse_args()
    model = build(args.hidden, args.layers, args.image_size)
    prompts, images = workload(args.requests, args.image_size)
    tokens = args.requests * args.max_new_tokens
    base_s, reference = one_by_one(model, prompts, images, args.max_new_tokens)
    padded_s, padded_out = padded(model, prompts, images, args.max_new_tokens)
    ours_s, ours_out, encode_s = ours(model, prompts, images, args.max_new_tokens)
    print("| engine | wall s | tok/s | encoder s | equal to one-by-one |")
    print("|---|---|---|---|---|")
    for name, seconds, outputs, encoder in (
        ("generate() one by one", base_s, reference, "-"),
        ("generate() padded batch", padded_s, padded_out, "-"),
        ("ours (generate_batch)", ours_s, ours_out, f"{encode_s:.3f}"),
    ):
        equal = sum(a == b for a, b in zip(outputs, reference, strict=True))
        print(f"| {name} | {seconds:.2f} | {tokens / seconds:.1f} | {encoder} | {equal}/{len(reference)} |")


if __name__ == "__main__":
    main()
