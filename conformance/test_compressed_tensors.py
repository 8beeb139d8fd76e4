"""compressed-tensors W8A16 / W4A16 checkpoints against their reference: `generate()` on the same model.

A seeded tiny Llama (sharp attention; hidden size 128, so that the presets' groups of 128 divide every
Linear) is quantized with compressed-tensors' `W8A16` or `W4A16` preset (the weight scales computed here
from each group's range, as a calibration of weights alone would), compressed, saved to a local folder and
loaded by transformers (`from_pretrained`: its compressed-tensors quantizer). transformers 5.23 has no CPU
kernel for such weights: compressed-tensors decompresses them into float weights at the model's first
forward (a forward pre-hook). The engine runs `model.forward`, which bypasses that hook, so it runs the
decompression first (engine/weights/pending_decompression.py); the test gives `generate_batch` the model straight
from `from_pretrained`, the hook still pending. Judged tie-aware, float32 and bfloat16
(docs/quantization.md).

Skipped, with the reason, where compressed-tensors is not installed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conformance.common import ReferenceCache, check_parity, greedy_config, run_batch, tight_num_blocks
from tests.support.models import tiny_llama
from tests.support.prompts import random_prompts
from tests.support.sharp import sharpen

pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed")

MAX_NEW_TOKENS = 10
PROMPTS = random_prompts(6, 300, 1, 40, seed=5)


def write_checkpoint(folder: Path, preset: str) -> None:
    """A tiny Llama quantized with `preset` (every Linear but the LM head), compressed and saved."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
    from compressed_tensors.quantization.utils import calculate_qparams

    model = tiny_llama(hidden_size=128, intermediate_size=256)
    sharpen(model)
    scheme = QuantizationScheme(targets=["Linear"], **PRESET_SCHEMES[preset])
    apply_quantization_config(
        model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"])
    )
    for module in model.modules():
        if hasattr(module, "weight_scale"):
            args = module.quantization_scheme.weights
            groups = module.weight.data.reshape(module.weight.shape[0], -1, args.group_size)
            scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
            module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data.copy_(zero_point.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(str(folder))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("preset", ["W8A16", "W4A16"])
def test_a_compressed_checkpoint_equals_its_own_generate(preset: str, dtype, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    write_checkpoint(tmp_path, preset)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype, device_map="cpu").eval()
    model.generation_config.eos_token_id = None
    assert hasattr(model.model.layers[0].mlp.up_proj, "weight_packed")  # compressed as loaded
    assert model._forward_pre_hooks, "compressed-tensors' decompression hook is not pending"
    num_blocks = tight_num_blocks(PROMPTS, MAX_NEW_TOKENS, 4)
    outputs, preempted = run_batch(
        model, PROMPTS, greedy_config(MAX_NEW_TOKENS), page_size=4, max_batch_tokens=16, num_blocks=num_blocks
    )
    assert model.model.layers[0].mlp.up_proj.weight.dtype == dtype  # decompressed by the engine
    references = ReferenceCache(model, MAX_NEW_TOKENS)
    context = f"compressed-tensors {preset}, {dtype}"
    check_parity(model, PROMPTS, outputs, [references.get(p) for p in PROMPTS], context)
    assert preempted, "nothing was preempted"
