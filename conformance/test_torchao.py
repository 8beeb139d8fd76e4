"""torchao int8 weight-only models against their reference: `generate()` on the same torchao model.

A seeded tiny Llama with sharp attention (its q/k projections scaled up) is quantized by torchao
(`quantize_(model, Int8WeightOnlyConfig())`: every Linear, LM head included, int8 per row) in float32 and
bfloat16, and run through `generate_batch` (chunked prefill, preemption, prefix sharing, the native kernel
and the torch paths) and through the manager. The engine runs the decode rows' products on the native
`int8_matmul` (runner/products/torchao_linear.py: the test checks that it ran), prefill chunks beyond its row bound on
torchao's own product; `generate()` runs torchao's product everywhere. Judged as the float models are:
tie-aware (a differing token must be a near-tie of the reference's logits), the float32 sums running in
another order than torch's `mm`. bfloat16 rounds where torchao rounds (docs/quantization.md).

Skipped, with the reason, where torchao is not installed (the `torchao` extra).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from conformance.common import ReferenceCache, check_parity, greedy_config, run_batch, tight_num_blocks
from tests.support.models import tiny_llama
from tests.support.prompts import random_prompts
from tests.support.sharp import sharpen
from transformers_cb import ContinuousBatchingConfig
from transformers_cb.attention.native.kernel import ENV_SWITCH, ensure_native_module
from transformers_cb.runner.products import torchao_linear
from transformers_cb.runner.products.quantized_linear import DIRECT_MAX_ROWS

quantization = pytest.importorskip(
    "torchao.quantization", reason="torchao is not installed (pip install 'transformers-cb[torchao]')"
)

MAX_NEW_TOKENS = 12
PROMPTS = random_prompts(8, 300, 1, 40, seed=3)


def quantized_llama(dtype: torch.dtype) -> torch.nn.Module:
    model = tiny_llama()
    sharpen(model)
    model.generation_config.eos_token_id = None  # every request runs to its token limit
    model = model.to(dtype)
    quantization.quantize_(model, quantization.Int8WeightOnlyConfig())
    assert type(model.lm_head.weight).__name__ == "Int8Tensor"
    return model


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def quantized(request):
    if ensure_native_module(timeout=900) is None:
        pytest.skip("the native library cannot be built here")
    model = quantized_llama(request.param)
    return model, ReferenceCache(model, MAX_NEW_TOKENS)


@contextmanager
def native_products() -> Iterator[list[int]]:
    """Counts the products `int8_matmul` ran (rows of each)."""
    rows: list[int] = []
    original = torchao_linear.int8_product

    def counting(x, weight, bias):
        output = original(x, weight, bias)
        if output is not None:
            rows.append(x.numel() // x.shape[-1])
        return output

    torchao_linear.int8_product = counting
    try:
        yield rows
    finally:
        torchao_linear.int8_product = original


@pytest.mark.parametrize("native", ["1", "0"], ids=["native", "torch"])
@pytest.mark.parametrize("budget", [6, None], ids=lambda b: f"budget{b}")
def test_int8_weight_only_equals_its_own_generate(
    quantized, budget: int | None, native: str, monkeypatch
) -> None:
    model, references = quantized
    monkeypatch.setenv(ENV_SWITCH, native)
    with native_products() as rows:
        outputs, _ = run_batch(
            model, PROMPTS, greedy_config(MAX_NEW_TOKENS), page_size=4, max_batch_tokens=budget
        )
    context = f"torchao int8 / {model.dtype} / max_batch_tokens={budget}, native={native}"
    check_parity(model, PROMPTS, outputs, [references.get(p) for p in PROMPTS], context)
    if native == "1":
        assert rows and min(rows) >= 1, f"{context}: int8_matmul never ran"
    else:
        assert not rows, f"{context}: int8_matmul ran with the native library switched off"


def test_int8_weight_only_under_preemption(quantized) -> None:
    model, references = quantized
    num_blocks = tight_num_blocks(PROMPTS, MAX_NEW_TOKENS, 4)
    outputs, preempted = run_batch(
        model, PROMPTS, greedy_config(MAX_NEW_TOKENS), page_size=4, max_batch_tokens=16, num_blocks=num_blocks
    )
    check_parity(model, PROMPTS, outputs, [references.get(p) for p in PROMPTS], "torchao int8, preempting")
    assert preempted, "nothing was preempted"


def test_int8_weight_only_prefix_sharing(quantized) -> None:
    model, references = quantized
    shared = PROMPTS[0] * 3
    prompts = [shared + p[:5] for p in PROMPTS[1:5]]
    outputs, _ = run_batch(model, prompts, greedy_config(MAX_NEW_TOKENS), page_size=4, max_batch_tokens=16)
    check_parity(model, prompts, outputs, [references.get(p) for p in prompts], "torchao int8, shared prefix")


def test_int8_weight_only_through_the_manager(quantized) -> None:
    model, references = quantized
    manager = model.init_continuous_batching(
        generation_config=greedy_config(MAX_NEW_TOKENS),
        continuous_batching_config=ContinuousBatchingConfig(page_size=4, max_batch_tokens=16),
    )
    manager.start()
    try:
        with native_products() as rows:
            ids = manager.add_requests(PROMPTS, max_new_tokens=MAX_NEW_TOKENS)
            outputs = {output.request_id: output for output in manager}
    finally:
        manager.stop(hard_stop=True)
    results = {f"req_{i}": outputs[rid] for i, rid in enumerate(ids)}
    check_parity(model, PROMPTS, results, [references.get(p) for p in PROMPTS], "torchao int8, manager")
    assert rows, "int8_matmul never ran in the manager's thread"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_checkpoint_loaded_with_torchao_config(dtype, tmp_path) -> None:
    """transformers' own route: `from_pretrained(..., quantization_config=TorchAoConfig(Int8WeightOnlyConfig()))`
    on a local checkpoint (transformers leaves the LM head float: it runs packed, the rest on int8_matmul)."""
    from transformers import AutoModelForCausalLM, TorchAoConfig

    if ensure_native_module(timeout=900) is None:
        pytest.skip("the native library cannot be built here")
    float_model = tiny_llama()
    sharpen(float_model)
    float_model.save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(
        tmp_path,
        dtype=dtype,
        device_map="cpu",
        quantization_config=TorchAoConfig(quantization.Int8WeightOnlyConfig()),
    ).eval()
    model.generation_config.eos_token_id = None
    assert type(model.model.layers[0].mlp.up_proj.weight).__name__ == "Int8Tensor"
    references = ReferenceCache(model, MAX_NEW_TOKENS)
    with native_products() as rows:
        outputs, _ = run_batch(
            model, PROMPTS, greedy_config(MAX_NEW_TOKENS), page_size=4, max_batch_tokens=16
        )
    check_parity(model, PROMPTS, outputs, [references.get(p) for p in PROMPTS], f"TorchAoConfig, {dtype}")
    assert rows, "int8_matmul never ran"


@contextmanager
def block_products() -> Iterator[list[int]]:
    """Counts the products the Intx Linears ran over their GGUF blocks (rows of each)."""
    rows: list[int] = []
    original = torchao_linear.quantized_product

    def counting(x, blocks, qtype):
        rows.append(x.shape[0])
        return original(x, blocks, qtype)

    torchao_linear.quantized_product = counting
    try:
        yield rows
    finally:
        torchao_linear.quantized_product = original


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_int4_weight_only_equals_its_own_generate(dtype) -> None:
    """int4 weight-only on the CPU (torchao 0.18's `Int4WeightOnlyConfig` layouts need CUDA or mslk):
    `IntxWeightOnlyConfig(weight_dtype=torch.int4)`, per group of 32, one int8 per value, which torchao
    dequantizes at each product before `F.linear`. In bfloat16 its scales are float16 values, so the engine
    writes GGUF Q4_0 blocks of the same weights and runs the decode rows on their native product; in
    float32 (float32 scales) torchao's own product runs, in the engine as in `generate()`."""
    if ensure_native_module(timeout=900) is None:
        pytest.skip("the native library cannot be built here")
    model = tiny_llama()
    sharpen(model)
    model.generation_config.eos_token_id = None
    model = model.to(dtype)
    config = quantization.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=quantization.PerGroup(32))
    quantization.quantize_(model, config)
    assert type(model.lm_head.weight).__name__ == "IntxUnpackedToInt8Tensor"
    references = ReferenceCache(model, MAX_NEW_TOKENS)
    num_blocks = tight_num_blocks(PROMPTS, MAX_NEW_TOKENS, 4)
    with native_products() as int8_rows, block_products() as block_rows:
        outputs, preempted = run_batch(
            model,
            PROMPTS,
            greedy_config(MAX_NEW_TOKENS),
            page_size=4,
            max_batch_tokens=16,
            num_blocks=num_blocks,
        )
    check_parity(model, PROMPTS, outputs, [references.get(p) for p in PROMPTS], f"torchao int4, {dtype}")
    assert preempted and not int8_rows
    if dtype == torch.bfloat16:
        assert block_rows, "the blocks' product never ran"
        assert max(block_rows) <= DIRECT_MAX_ROWS[torch.bfloat16]  # torchao's own product beyond
    else:
        assert not block_rows  # float32 scales are not float16 values: torchao's product
