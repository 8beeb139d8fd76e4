"""A GGUF model kept quantized (`models/gguf_weights.py`): a seeded tiny Llama written with Q8_0, Q4_0 or
Q4_1 blocks (q/k scaled up: sharp attention, and the q/k row permutation transformers applies on load
matters), loaded by transformers (`from_pretrained(folder, gguf_file=...)`, dequantized), its Linears and
tied embedding put back into their blocks; greedy `generate_batch` on it equals `generate()` on the
dequantized model except at stated near-ties (the reference of docs/quantization.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, GenerationConfig

from tests.support.prompts import prompts_of_lengths
from tests.support.reference import greedy_reference
from tests.support.tiny_gguf import write_tiny_gguf
from transformers_cb.attention.native.kernel import native_module
from transformers_cb.models.gguf_convert import convert_gguf
from transformers_cb.models.gguf_weights import (
    GGUF_KEY,
    PROVENANCE,
    gguf_file_of,
    gguf_of_folder,
    keep_gguf_quantized,
)
from transformers_cb.models.loading import load_model_and_tokenizer, quantized_source
from transformers_cb.parity.compare import compare_tokens
from transformers_cb.runner.products.packed_linear import PackRule
from transformers_cb.runner.products.packed_model import pack_bytes, packing_settings
from transformers_cb.runner.products.quantized_linear import QuantizedEmbedding, QuantizedLinear

gguf = pytest.importorskip("gguf", reason="the gguf package writes the test's GGUF files")
QTYPES = [gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1]
LAYERS, LINEARS_PER_LAYER = 2, 7
MAX_NEW_TOKENS = 12


@pytest.fixture(scope="module", params=QTYPES, ids=lambda q: q.name)
def gguf_path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp(f"gguf_{request.param.name}")
    return write_tiny_gguf(folder / "tiny.gguf", seed=3, quant=int(request.param), qk_scale=6.0)


def load(path: Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=dtype, attn_implementation="paged|sdpa"
    )
    return model.eval()


def test_every_linear_and_the_tied_embedding_are_kept_in_blocks(gguf_path: Path) -> None:
    model = load(gguf_path)
    float_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert gguf_file_of(model) is not None and Path(gguf_file_of(model) or "").name == gguf_path.name
    report = keep_gguf_quantized(model)  # the file transformers recorded
    assert report.left_float == {}
    assert len(report.quantized) == LAYERS * LINEARS_PER_LAYER + 2  # + the embedding and its tied head
    assert not [name for name, m in model.named_modules() if type(m) in (nn.Linear, nn.Embedding)]
    inner = model.get_submodule("model")
    assert isinstance(inner.embed_tokens, QuantizedEmbedding) and isinstance(model.lm_head, QuantizedLinear)
    assert model.lm_head.blocks is inner.embed_tokens.blocks or (
        model.lm_head.blocks.data_ptr() == inner.embed_tokens.blocks.data_ptr()
    )
    left = sum(p.numel() * p.element_size() for p in model.parameters())  # the norms only
    assert left + report.float_bytes_dropped == float_bytes
    assert report.quantized_bytes < report.float_bytes_dropped / 3
    # Packing (oneDNN copies of float weights) finds nothing to pack, and its memory check counts nothing.
    rule = PackRule(every_weight=True)
    assert packing_settings(model, rule).pack_sizes() == [] and pack_bytes(model, rule) == (0, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_greedy_outputs_equal_generate_on_the_dequantized_weights(
    gguf_path: Path, dtype: torch.dtype
) -> None:
    reference = load(gguf_path, dtype)
    model = load(gguf_path, dtype)
    report = keep_gguf_quantized(model)
    ops = native_module()
    if dtype == torch.bfloat16 and ops and ops.quant_lanes_available():
        # the layers' Linears over lanes; the tied embedding and head not (261 rows: no whole lane groups)
        assert len(report.lanes) == LAYERS * LINEARS_PER_LAYER and "lm_head" not in report.lanes
    else:
        assert report.lanes == []
    prompts = prompts_of_lengths([3, 9, 17, 30, 41, 64], vocab=261, seed=5)
    config = GenerationConfig(
        max_new_tokens=MAX_NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    outputs = model.generate_batch(inputs=prompts, generation_config=config)
    agreed, near_ties = 0, []
    for i, prompt in enumerate(prompts):
        expected = greedy_reference(reference, prompt, MAX_NEW_TOKENS)
        actual = outputs[f"req_{i}"].generated_tokens
        mismatch = compare_tokens(reference, f"req_{i}", prompt, expected, actual)
        if mismatch is None:
            agreed += 1
            continue
        assert mismatch.is_near_tie, mismatch.describe()
        near_ties.append(mismatch.margin)
    # Equal except at near-ties, and mostly equal outright (a near-tie only on an unlucky prompt).
    assert agreed >= len(prompts) - 1, near_ties


def test_a_tied_embedding_and_head_go_over_lanes_together(tmp_path: Path) -> None:
    """A vocabulary of whole lane groups (272): the tied embedding and LM head share one repacked tensor, and
    greedy outputs still equal `generate()` on the dequantized bfloat16 weights except at near-ties."""
    ops = native_module()
    if ops is None or not ops.quant_lanes_available():
        pytest.skip("the lane product needs the native library with AVX512-BF16")
    path = write_tiny_gguf(
        tmp_path / "tiny.gguf",
        seed=4,
        quant=int(gguf.GGMLQuantizationType.Q8_0),
        qk_scale=6.0,
        extra_tokens=11,
    )
    reference, model = load(path, torch.bfloat16), load(path, torch.bfloat16)
    report = keep_gguf_quantized(model)
    assert {"lm_head", "model.embed_tokens"} <= set(report.lanes)
    assert len(report.lanes) == LAYERS * LINEARS_PER_LAYER + 2
    assert model.lm_head.blocks is model.get_submodule("model.embed_tokens").blocks
    as_blocks = keep_gguf_quantized(load(path, torch.bfloat16), lanes=False)
    assert as_blocks.lanes == [] and as_blocks.quantized_bytes == report.quantized_bytes  # the same bytes
    prompts = prompts_of_lengths([3, 9, 17, 30, 41, 64], vocab=272, seed=6)
    config = GenerationConfig(
        max_new_tokens=MAX_NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    outputs = model.generate_batch(inputs=prompts, generation_config=config)
    agreed = 0
    for i, prompt in enumerate(prompts):
        expected = greedy_reference(reference, prompt, MAX_NEW_TOKENS)
        mismatch = compare_tokens(
            reference, f"req_{i}", prompt, expected, outputs[f"req_{i}"].generated_tokens
        )
        assert mismatch is None or mismatch.is_near_tie, mismatch.describe()
        agreed += mismatch is None
    assert agreed >= len(prompts) - 1


def test_the_loader_keeps_a_folder_s_gguf_and_the_switch_turns_it_off(
    gguf_path: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "converted"
    convert_gguf(gguf_path, folder, show_progress=False)  # what models/fetch.py does
    (folder / gguf_path.name).write_bytes(gguf_path.read_bytes())
    assert gguf_of_folder(folder) is None  # not named by the folder: not kept
    (folder / PROVENANCE).write_text(json.dumps({GGUF_KEY: gguf_path.name}))
    assert gguf_of_folder(folder) == folder / gguf_path.name
    model, _tokenizer = load_model_and_tokenizer(str(folder), quantized_weights=True, progress=False)
    assert isinstance(model.lm_head, QuantizedLinear)
    model, _tokenizer = load_model_and_tokenizer(str(folder), quantized_weights=False, progress=False)
    assert type(model.lm_head) is nn.Linear
    model, _tokenizer = load_model_and_tokenizer(str(folder), progress=False)  # the default: float weights
    assert type(model.lm_head) is nn.Linear
    assert quantized_source(str(folder), str(folder), True, "cpu") == folder / gguf_path.name
    with pytest.raises(ValueError, match="CPU only"):
        quantized_source(str(folder), str(folder), True, "cuda")
    with pytest.raises(ValueError, match="keeps no GGUF"):
        quantized_source(str(tmp_path), str(tmp_path), True, "cpu")
    with pytest.raises(ValueError, match="not the built-in tiny model"):
        quantized_source(None, None, True, "cpu")
