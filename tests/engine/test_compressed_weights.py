"""engine/weights/compressed_weights.py: compressed-tensors' packed int4 / int8 Linears rewritten into GGUF blocks.

Each Linear is compressed by compressed-tensors' own `PackedQuantizationCompressor` and its decompression
(the hook's) is the reference: the blocks must hold exactly its float32 weight. Skipped where
compressed-tensors is not installed.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from transformers_cb.engine.weights import compressed_weights
from transformers_cb.engine.weights.compressed_weights import (
    KEEP_ENV,
    compressed_blocks,
    keep_compressed,
    keep_pending_compressed,
)
from transformers_cb.runner.products.quantized_linear import (
    Q4_0,
    Q8_0,
    QuantizedLinear,
    dequantize_blocks,
)

pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed")


def compressed_linear(
    in_features: int,
    out_features: int,
    bits: int,
    strategy: str = "group",
    group_size: int | None = 128,
    symmetric: bool = True,
    scale_dtype: torch.dtype = torch.bfloat16,
    bias: bool = False,
    seed: int = 0,
) -> tuple[nn.Linear, torch.Tensor]:
    """A Linear compressed as compressed-tensors leaves it at load (`weight_packed`, `weight_scale`,
    `weight_shape`, its scheme), and its decompressed float32 weight (compressed-tensors' decompression)."""
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    generator = torch.Generator().manual_seed(seed)
    linear = nn.Linear(in_features, out_features, bias=bias)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.05
    args = QuantizationArgs(
        num_bits=bits,
        symmetric=symmetric,
        strategy=strategy,
        group_size=group_size if strategy == "group" else None,
    )
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    width = group_size if strategy == "group" else in_features
    groups = weight.reshape(out_features, -1, width) if strategy != "tensor" else weight.reshape(1, 1, -1)
    scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
    scale = scale.reshape(groups.shape[0], -1).to(scale_dtype).float()  # a checkpoint's values
    state = {"weight": weight, "weight_scale": scale, "weight_zero_point": zero_point.reshape(scale.shape)}
    compressed = PackedQuantizationCompressor.compress(state, scheme)
    reference = PackedQuantizationCompressor.decompress(compressed, scheme)["weight"].float()
    del linear.weight
    for name in ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point"):
        if name in compressed:
            setattr(linear, name, nn.Parameter(compressed[name], requires_grad=False))
    linear.quantization_scheme = scheme
    return linear, reference


@pytest.mark.parametrize(
    ("bits", "strategy", "group_size"),
    [(4, "group", 128), (4, "group", 32), (4, "channel", None), (8, "group", 64), (8, "channel", None)],
)
def test_the_blocks_hold_compressed_tensors_decompressed_weight_bit_for_bit(
    bits, strategy, group_size
) -> None:
    linear, reference = compressed_linear(256, 48, bits, strategy, group_size)
    converted = compressed_blocks(linear)
    assert not isinstance(converted, str), converted
    blocks, qtype = converted
    assert qtype == (Q4_0 if bits == 4 else Q8_0)
    assert blocks.dtype == torch.uint8 and blocks.shape[0] == 48
    assert torch.equal(dequantize_blocks(blocks, qtype, torch.float32), reference)


def test_a_tensor_wide_scale_is_every_blocks() -> None:
    linear, reference = compressed_linear(64, 16, 8, "tensor", None)
    blocks, qtype = compressed_blocks(linear)  # type: ignore[misc]
    assert torch.equal(dequantize_blocks(blocks, qtype, torch.float32), reference)


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"symmetric": False}, "asymmetric"),
        ({"scale_dtype": torch.float32}, "not float16 values"),
        ({"group_size": 16}, "not whole blocks"),
        ({"bits": 2}, "int4 and int8 only"),
    ],
)
def test_what_cannot_be_blocks_is_left_with_the_reason(kwargs, reason) -> None:
    settings = {"bits": 4, "group_size": 64, **kwargs}
    linear, _ = compressed_linear(128, 16, **settings)
    converted = compressed_blocks(linear)
    assert isinstance(converted, str) and reason in converted, converted


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keep_compressed_replaces_the_linears_it_takes_and_leaves_the_rest(dtype) -> None:
    kept, reference = compressed_linear(128, 32, 4, bias=True)
    left, _ = compressed_linear(128, 32, 4, symmetric=False, seed=1)
    kept.bias.data = kept.bias.data.to(dtype)
    kept.weight_scale.data = kept.weight_scale.data.to(dtype)
    model = nn.Sequential(kept, nn.ReLU(), left)
    report = keep_compressed(model, lanes=True)
    assert report.kept == ["0"] and list(report.left) == ["2"] and "asymmetric" in report.left["2"]
    module = model[0]
    assert isinstance(module, QuantizedLinear) and module.compute_dtype == dtype
    assert model[2] is left
    assert report.quantized_bytes == 32 * 4 * 18  # 4 blocks of 18 bytes a row
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(2)).to(dtype)
    expected = F.linear(x.double(), reference.double(), kept.bias.double())
    assert torch.allclose(
        module(x).double(), expected, rtol=0.02 if dtype == torch.bfloat16 else 1e-5, atol=1e-3
    )


@pytest.mark.parametrize(("value", "lanes"), [(None, False), ("1", False), ("lanes", True)])
def test_the_switch_picks_the_blocks_or_the_lanes(monkeypatch, value, lanes) -> None:
    ops = compressed_weights.native_module()
    if ops is None or not ops.quant_lanes_available():
        pytest.skip("the native library with the lane product is not loaded")
    if value is None:
        monkeypatch.delenv(KEEP_ENV, raising=False)
    else:
        monkeypatch.setenv(KEEP_ENV, value)
    linear, _ = compressed_linear(128, 16, 4)
    linear.weight_scale.data = linear.weight_scale.data.to(torch.bfloat16)  # a bfloat16 model's
    model = nn.Sequential(linear)
    report = keep_pending_compressed(model)
    assert report is not None and report.kept == ["0"] and (report.lanes == ["0"]) == lanes


def test_the_switch_and_a_missing_library_decompress_everything(monkeypatch) -> None:
    linear, _ = compressed_linear(128, 16, 4)
    model = nn.Sequential(linear)
    monkeypatch.setenv(KEEP_ENV, "0")
    assert keep_pending_compressed(model) is None and model[0] is linear
    monkeypatch.delenv(KEEP_ENV)
    monkeypatch.setattr(compressed_weights, "native_module", lambda: None)
    assert keep_pending_compressed(model) is None and model[0] is linear


def test_a_plain_model_is_not_touched() -> None:
    linear = nn.Linear(32, 4)
    model = nn.Sequential(linear)
    report = keep_compressed(model)
    assert report.kept == [] and report.left == {} and model[0] is linear
