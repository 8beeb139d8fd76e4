"""compressed-tensors W8A16 / W4A16 checkpoints against their reference: `generate()` on the decompressed model.

A seeded tiny Llama (sharp attention; hidden size 128, so that the presets' groups of 128 divide every
Linear) is quantized with compressed-tensors' `W8A16` or `W4A16` preset (the weight scales computed here
from each group's range, as a calibration of weights alone would; rounded to bfloat16 values, as a
checkpoint saved in bfloat16 holds them, or left float32), compressed, saved to a local folder and loaded
by transformers (`from_pretrained`: its compressed-tensors quantizer), its decompression hook pending.
The engine keeps the Linears whose values fit GGUF blocks compressed (engine/weights/compressed_weights.py:
float16-valued scales) and runs compressed-tensors' decompression for the rest
(engine/weights/pending_decompression.py); the reference is `generate()` on a second copy, decompressed by
compressed-tensors' own hook at its first forward. Judged tie-aware, float32 and bfloat16
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


def write_checkpoint(folder: Path, preset: str, bf16_scales: bool = True) -> None:
    """A tiny Llama quantized with `preset` (every Linear but the LM head), its scales bfloat16 values (with
    `bf16_scales`), compressed and saved."""
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
            if bf16_scales:
                scale = scale.to(torch.bfloat16).float()
            module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data.copy_(zero_point.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(str(folder))


@pytest.mark.parametrize(
    ("dtype", "bf16_scales", "keep"),
    [
        (torch.float32, True, "1"),
        (torch.bfloat16, True, "1"),
        (torch.bfloat16, True, "lanes"),
        (torch.float32, False, "1"),
    ],
    ids=["fp32", "bf16", "bf16-lanes", "fp32-float32-scales"],
)
@pytest.mark.parametrize("preset", ["W8A16", "W4A16"])
def test_a_compressed_checkpoint_equals_generate_on_it_decompressed(
    preset: str, dtype, bf16_scales: bool, keep: str, tmp_path, monkeypatch
) -> None:
    from transformers import AutoModelForCausalLM

    from transformers_cb.attention.native.kernel import native_module
    from transformers_cb.runner.products.quantized_linear import LANES, QuantizedLinear

    monkeypatch.setenv("TRANSFORMERS_CB_KEEP_COMPRESSED", keep)
    write_checkpoint(tmp_path, preset, bf16_scales)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype, device_map="cpu").eval()
    model.generation_config.eos_token_id = None
    assert hasattr(model.model.layers[0].mlp.up_proj, "weight_packed")  # compressed as loaded
    assert model._forward_pre_hooks, "compressed-tensors' decompression hook is not pending"
    num_blocks = tight_num_blocks(PROMPTS, MAX_NEW_TOKENS, 4)
    outputs, preempted = run_batch(
        model, PROMPTS, greedy_config(MAX_NEW_TOKENS), page_size=4, max_batch_tokens=16, num_blocks=num_blocks
    )
    up_proj = model.model.layers[0].mlp.up_proj
    if bf16_scales:  # kept: float16-valued scales
        assert isinstance(up_proj, QuantizedLinear), type(up_proj)
        assert up_proj.qtype == (2 if preset == "W4A16" else 8)
        ops = native_module()
        lanes = keep == "lanes" and ops is not None and ops.quant_lanes_available()
        assert (up_proj.kernel_qtype > LANES) == lanes  # by default the blocks round as decompression does
    else:  # float32 scales: compressed-tensors decompresses them, as before
        assert up_proj.weight.dtype == dtype
    assert isinstance(model.lm_head, torch.nn.Linear)  # never quantized (the checkpoint's `ignore`)
    # compressed-tensors' CPU-to-CPU offloading and weight-only quantized forwards undone: the engine's
    # native paths take every module (engine/weights/pending_decompression.py)
    wrapped = [name for name, module in model.named_modules() if "forward" in module.__dict__]
    assert wrapped == [], wrapped
    assert all(type(module._parameters) is dict for module in model.modules())
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype, device_map="cpu").eval()
    reference.generation_config.eos_token_id = None
    references = ReferenceCache(reference, MAX_NEW_TOKENS)  # its first forward decompresses it
    context = f"compressed-tensors {preset}, {dtype}, bf16 scales {bf16_scales}, kept as {keep}"
    check_parity(reference, PROMPTS, outputs, [references.get(p) for p in PROMPTS], context)
    assert reference.model.layers[0].mlp.up_proj.weight.dtype == dtype
    assert preempted, "nothing was preempted"


def test_a_checkpoint_decompressed_by_generate_first_runs_unwrapped(tmp_path) -> None:
    """`generate()` before `generate_batch`: compressed-tensors' own hook decompresses the model (everything
    float, every module wrapped by its offloading); the engine then undoes the wrappers that move nothing, so
    its native paths take every module, and the outputs stay `generate()`'s."""
    from transformers import AutoModelForCausalLM

    write_checkpoint(tmp_path, "W4A16", bf16_scales=False)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, device_map="cpu").eval()
    model.generation_config.eos_token_id = None
    references = ReferenceCache(model, MAX_NEW_TOKENS)
    expected = [references.get(p) for p in PROMPTS]  # its first forward decompresses it
    assert not model._forward_pre_hooks
    assert [name for name, module in model.named_modules() if "forward" in module.__dict__]  # wrapped
    outputs, _ = run_batch(model, PROMPTS, greedy_config(MAX_NEW_TOKENS), page_size=4, max_batch_tokens=16)
    wrapped = [name for name, module in model.named_modules() if "forward" in module.__dict__]
    assert wrapped == [], wrapped
    check_parity(model, PROMPTS, outputs, expected, "compressed-tensors W4A16 after generate()")
