"""Tiny vision-language models built from their configs (no download), their prompts with image
placeholders, and the greedy reference of `generate()` on one prompt with its processor-shaped inputs."""

from __future__ import annotations

from typing import Any

import torch
from transformers import (
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    PreTrainedModel,
)

# Llava: a 28x28 image is 2x2 patches of 14 (the CLS row is dropped): 4 placeholder tokens per image.
LLAVA_IMAGE_TOKEN = 100
LLAVA_TOKENS_PER_IMAGE = 4
LLAVA_VOCAB = 128


def build_tiny_llava(
    seed: int = 0,
    image_token: int = LLAVA_IMAGE_TOKEN,
    vocab_size: int = LLAVA_VOCAB,
    max_position_embeddings: int = 256,
) -> PreTrainedModel:
    """A tiny Llava (one CLIP layer over 28x28 images, two Llama layers); the server's tests give their
    tokenizer's vocabulary and image token."""
    torch.manual_seed(seed)
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
        projection_dim=32,
    )
    text = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
    )
    config = LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=image_token, vision_feature_layer=-1
    )
    return LlavaForConditionalGeneration(config).eval()


def llava_image(seed: int, count: int = 1) -> torch.Tensor:
    """`count` random 28x28 images as the processor's `pixel_values` `[count, 3, 28, 28]`."""
    return torch.randn(count, 3, 28, 28, generator=torch.Generator().manual_seed(seed))


def with_images(parts: list[list[int] | int]) -> list[int]:
    """A prompt from text runs (lists of ids) and images (an int: one image's placeholder tokens)."""
    prompt: list[int] = []
    for part in parts:
        prompt.extend([LLAVA_IMAGE_TOKEN] * LLAVA_TOKENS_PER_IMAGE if isinstance(part, int) else part)
    return prompt


@torch.inference_mode()
def media_reference(
    model: PreTrainedModel, prompt: list[int], media: dict[str, Any], max_new_tokens: int
) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs from plain `generate()` on one prompt with its media."""
    ids = torch.tensor([prompt], dtype=torch.long)
    output = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
        output_scores=True,
        return_dict_in_generate=True,
        **media,
    )
    tokens = output.sequences[0, len(prompt) :].tolist()
    logprobs = [
        torch.log_softmax(score[0].float(), -1)[token].item()
        for score, token in zip(output.scores, tokens, strict=True)
    ]
    return tokens, logprobs


# Qwen2-VL: 14-pixel patches merged 2x2; an image of a (h, w) patch grid is h * w / 4 placeholder tokens
# between its vision start / end tokens; 3-D rotary positions (M-RoPE).
QWEN2_VL_IMAGE_TOKEN = 150
QWEN2_VL_VISION_START, QWEN2_VL_VISION_END = 152, 153


def build_tiny_qwen2_vl(seed: int = 0) -> PreTrainedModel:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    torch.manual_seed(seed)
    config = Qwen2VLConfig(
        text_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "vocab_size": 160,
            "max_position_embeddings": 256,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
        },
        vision_config={
            "depth": 1,
            "embed_dim": 32,
            "hidden_size": 32,
            "num_heads": 2,
            "mlp_ratio": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_channels": 3,
        },
        image_token_id=QWEN2_VL_IMAGE_TOKEN,
        video_token_id=151,
        vision_start_token_id=QWEN2_VL_VISION_START,
        vision_end_token_id=QWEN2_VL_VISION_END,
    )
    return Qwen2VLForConditionalGeneration(config).eval()


def qwen2_vl_image(seed: int, height: int = 4, width: int = 4) -> dict[str, torch.Tensor]:
    """One image as Qwen2-VL's processor gives it: flattened patches and its `image_grid_thw`."""
    patches = torch.randn(height * width, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(seed))
    return {"pixel_values": patches, "image_grid_thw": torch.tensor([[1, height, width]])}


def qwen2_vl_placeholders(height: int = 4, width: int = 4) -> list[int]:
    return [QWEN2_VL_VISION_START, *[QWEN2_VL_IMAGE_TOKEN] * (height * width // 4), QWEN2_VL_VISION_END]


def mm_token_type_ids(prompt: list[int], image_token: int) -> torch.Tensor:
    """What the processor returns beside Qwen2-VL's prompt: 1 at image placeholders, 0 elsewhere."""
    ids = torch.tensor([prompt])
    return (ids == image_token).to(torch.int)


# -- the judged families, built from the coverage matrix's tiny configs --------------------------------
# Each family's vision tower is shrunk to its smallest images (a few patches) so the encoder is fast.
JUDGED_FAMILIES = (
    "llava",
    "llava_next",
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
    "idefics3",
    "smolvlm",
    "internvl",
    "mistral3",
    "gemma3",
)
MROPE_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


def build_family_vlm(family: str) -> PreTrainedModel:
    """The family's image-text-to-text class from the coverage matrix's tiny config, with small images."""
    from transformers import AutoModelForImageTextToText, GenerationConfig

    from conformance.coverage.build import SEED, entry_config
    from conformance.coverage.catalog import all_entries

    entries = {entry.name: entry for entry in all_entries()}
    config = entry_config(entries.get(f"{family}:vlm", entries.get(family)))
    vision = config.vision_config
    if family in ("llava", "llava_next", "gemma3"):
        vision.image_size, vision.patch_size = 28, 14
    if family == "gemma3":  # 2x2 patches pooled to 2x2 tokens: 4 placeholders per image
        config.mm_tokens_per_image = 4
    if family == "llava_next":
        config.image_grid_pinpoints = [[28, 28], [28, 56]]
    if family == "internvl":
        vision.image_size, vision.patch_size = [28, 28], [14, 14]
    if family in ("idefics3", "smolvlm"):
        vision.image_size, vision.patch_size = 64, 16
    if family == "mistral3":
        vision.image_size, vision.patch_size = 56, 14
    if family == "qwen3_vl":  # the shrunk vision tower's layers feed the decoder's first layers (deepstack)
        vision.deepstack_visual_indexes = list(range(min(vision.depth, config.text_config.num_hidden_layers)))
    torch.manual_seed(SEED)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32).eval()
    model.generation_config = GenerationConfig(bos_token_id=None, pad_token_id=0, eos_token_id=None)
    if (
        family == "gemma3"
    ):  # its projection starts at zeros (every image the same rows): random, so images count
        with torch.no_grad():
            model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 1.0)
    return model


def image_token_of(model: PreTrainedModel) -> int:
    config = model.config
    return next(
        value
        for name in ("image_token_id", "image_token_index")
        if isinstance(value := getattr(config, name, None), int)
    )


def family_images(model: PreTrainedModel, family: str, seed: int, count: int) -> dict[str, torch.Tensor]:
    """`count` random images shaped as the family's processor gives them for one prompt."""
    generator = torch.Generator().manual_seed(seed)
    if family in ("llava", "internvl", "gemma3"):
        return {"pixel_values": torch.randn(count, 3, 28, 28, generator=generator)}
    if family == "llava_next":  # a 28x56 image: the base image and its 2 tiles
        return {
            "pixel_values": torch.randn(count, 3, 3, 28, 28, generator=generator),
            "image_sizes": torch.tensor([[28, 56]] * count),
        }
    if family in ("idefics3", "smolvlm"):
        return {
            "pixel_values": torch.randn(1, count, 3, 64, 64, generator=generator),
            "pixel_attention_mask": torch.ones(1, count, 64, 64, dtype=torch.bool),
        }
    if family == "mistral3":
        return {
            "pixel_values": torch.randn(count, 3, 56, 56, generator=generator),
            "image_sizes": torch.tensor([[56, 56]] * count),
        }
    if family in MROPE_FAMILIES:  # a 4x4 patch grid, merged 2x2: 4 placeholders each
        patch = model.config.vision_config.patch_size
        return {
            "pixel_values": torch.randn(16 * count, 3 * 2 * patch * patch, generator=generator),
            "image_grid_thw": torch.tensor([[1, 4, 4]] * count),
        }
    raise ValueError(f"no image inputs for {family}")


@torch.inference_mode()
def family_prompt(
    model: PreTrainedModel, family: str, images: dict[str, torch.Tensor], text: list[int]
) -> list[int]:
    """`text[:2]`, each image's placeholders (as many as its encoder rows; Qwen's between vision start /
    end tokens), then `text[2:]`."""
    output = model.base_model.get_image_features(**images, return_dict=True).pooler_output
    rows = (
        [output.reshape(-1, output.shape[-1]).shape[0]]
        if isinstance(output, torch.Tensor)
        else [item.reshape(-1, item.shape[-1]).shape[0] for item in output]
    )
    if (
        family == "gemma3" and isinstance(output, torch.Tensor) and output.dim() == 3
    ):  # [images, rows, hidden]
        rows = [output.shape[1]] * output.shape[0]
    token = image_token_of(model)
    middle: list[int] = []
    for count in rows:
        if family in MROPE_FAMILIES:
            config = model.config
            middle += [config.vision_start_token_id, *[token] * count, config.vision_end_token_id]
        elif family == "gemma3":  # between its begin / end of image tokens: one block per image
            middle += [model.config.boi_token_index, *[token] * count, model.config.eoi_token_index]
        else:
            middle += [token] * count
    return [*text[:2], *middle, *text[2:]]


def family_extras(model: PreTrainedModel, family: str, prompt: list[int]) -> dict[str, torch.Tensor]:
    """What the family's processor returns beside the prompt and the images: Gemma 3's `token_type_ids`
    (1 at image placeholders: generate()'s prefill lets each image's run attend both ways)."""
    if family == "gemma3":
        return {"token_type_ids": mm_token_type_ids(prompt, image_token_of(model)).long()}
    return {}


def family_reference(
    model: PreTrainedModel,
    family: str,
    prompt: list[int],
    images: dict[str, torch.Tensor],
    max_new_tokens: int,
) -> tuple[list[int], list[float]]:
    """`generate()` on one prompt with the inputs its processor would add (M-RoPE's `mm_token_type_ids`,
    Gemma 3's `token_type_ids`)."""
    extra: dict[str, Any] = dict(images)
    if images and family in MROPE_FAMILIES:
        extra["mm_token_type_ids"] = mm_token_type_ids(prompt, image_token_of(model))
    if images:
        extra.update(family_extras(model, family, prompt))
    return media_reference(model, prompt, extra, max_new_tokens)


# -- a tiny Llava checkpoint with its processor, as a vision-language folder on disk -------------------
# The byte-level tiny tokenizer plus one `<image>` token; CLIP's image processor at 28x28 (4 patches of 14,
# the CLS row dropped: 4 placeholders per image), and a chat template that puts `<image>` where an image
# part is (string contents too, for the text-only path through the tokenizer).
LLAVA_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def save_tiny_llava_checkpoint(folder: Any, seed: int = 0) -> tuple[PreTrainedModel, Any]:
    """A tiny Llava and its `LlavaProcessor` saved to `folder` (what `transformers-cb serve --model folder`
    loads); returns both as saved. Needs Pillow (the PIL image processor: torchvision is not required)."""
    from transformers import CLIPImageProcessor, GenerationConfig, LlavaProcessor

    from transformers_cb.models.tiny import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    tokenizer.split_special_tokens = False  # `<image>` must stay one token for the processor to expand it
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tokenizer.chat_template = LLAVA_CHAT_TEMPLATE
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}),
        tokenizer=tokenizer,
        patch_size=14,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=LLAVA_CHAT_TEMPLATE,
        image_token="<image>",
    )
    torch.manual_seed(seed)
    vision = CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
        patch_size=14,
    )  # fmt: skip
    text = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=len(tokenizer), max_position_embeddings=512,
    )  # fmt: skip
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        vision_feature_layer=-1,
    )
    model = LlavaForConditionalGeneration(config).eval()
    model.generation_config = GenerationConfig(
        do_sample=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return model, processor


# -- audio: a tiny Voxtral (Whisper-style encoder, 4 frames merged per row) --------------------------------
VOXTRAL_AUDIO_TOKEN = 100
VOXTRAL_ROWS_PER_CLIP = 4  # 16 mel frames -> 8 encoder positions -> 4 rows of 4 x 32 merged to 64, projected


def build_tiny_voxtral(seed: int = 0) -> PreTrainedModel:
    from transformers import GenerationConfig, VoxtralConfig, VoxtralForConditionalGeneration

    config = VoxtralConfig(
        audio_config={
            "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
            "num_mel_bins": 16, "max_source_positions": 8,
        },
        text_config={
            "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 1, "vocab_size": 128, "max_position_embeddings": 256, "head_dim": 16,
        },
        audio_token_id=VOXTRAL_AUDIO_TOKEN,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = VoxtralForConditionalGeneration(config).eval()
    model.generation_config = GenerationConfig(bos_token_id=None, pad_token_id=0, eos_token_id=None)
    return model


def voxtral_clips(seed: int, count: int = 1) -> torch.Tensor:
    """`count` random clips as Voxtral's feature extractor gives them: `input_features` `[count, 16, 16]`
    (mel bins x frames, padded to the encoder's length)."""
    return torch.randn(count, 16, 16, generator=torch.Generator().manual_seed(seed))
