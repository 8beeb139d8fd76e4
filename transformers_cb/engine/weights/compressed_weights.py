"""compressed-tensors W4A16 / W8A16 Linears kept compressed: their values put in GGUF Q4_0 / Q8_0 blocks.

A compressed-tensors checkpoint in its `pack-quantized` format (llm-compressor's W4A16, W8A16) loads with
each quantized Linear holding `weight_packed` (int32 words, value i at bit `i * bits`, stored `q + 2^(bits-1)`),
`weight_scale` (one per group of `group_size` inputs, per row, or for the whole tensor) and no float
`weight`; compressed-tensors' first-forward hook then decompresses every one to `q * scale` in the scale's
dtype. A symmetric int4 value with its scale is exactly a Q4_0 block's (`d * (nibble - 8)`, 32 weights a
block), a symmetric int8 one a Q8_0 block's (`d * q`): when each scale is a float16 value (`d` is stored in
float16; a bfloat16 checkpoint's scales are) and every group is whole blocks, `keep_compressed` rewrites
the words and scales into blocks (the same values, bit for bit: 4.5 / 8.5 bits a weight against the
decompressed 16 / 32) and replaces the Linear by a `QuantizedLinear` (runner/products/quantized_linear.py),
which the GGUF models' native products run. The pending hook then decompresses
only what was not kept (asymmetric or activation-ordered weights, scales that are not float16 values, an
unquantized LM head), as before.

The reference stays `generate()` on the decompressed model: the blocks hold its weights exactly (`q * scale`
is exact in float32; the row-major blocks' bfloat16 product rounds each weight to bfloat16 where the
decompression does), so outputs differ by the order of the sums only. `TRANSFORMERS_CB_KEEP_COMPRESSED=lanes`
repacks a bfloat16 model's blocks over lanes (~1.2x faster a decode, but the weights are not rounded to
bfloat16: tie-aware only, docs/quantization.md); `=0` decompresses everything, as compressed-tensors would.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ...attention.native.kernel import native_module
from ...runner.products.gguf_blocks import QTYPE_OF_BITS, blocks_from_values
from ...runner.products.quantized_linear import (
    BLOCK_WEIGHTS,
    COMPUTE_DTYPES,
    QuantizedLinear,
    quantized_bytes,
    repack_lanes,
)

logger = logging.getLogger(__name__)

KEEP_ENV = "TRANSFORMERS_CB_KEEP_COMPRESSED"


@dataclass
class KeptCompressed:
    """What `keep_compressed` did: the Linears now in blocks, those left to decompression and why, bytes."""

    kept: list[str] = field(default_factory=list)
    left: dict[str, str] = field(default_factory=dict)
    quantized_bytes: int = 0
    # the modules repacked over lanes (a bfloat16 model's: `repack_over_lanes`)
    lanes: list[str] = field(default_factory=list)


def keep_compressed_mode() -> str | None:
    """How compressed checkpoints are kept (`TRANSFORMERS_CB_KEEP_COMPRESSED`): "blocks" (unset, the
    default: the row-major blocks, whose bfloat16 product rounds each weight to bfloat16 as the decompressed
    model holds it), "lanes" (over lanes: faster in bfloat16, the weights not rounded) or None ("0":
    decompressed)."""
    value = os.environ.get(KEEP_ENV, "1").strip().lower()
    if value in ("0", "false", "no", "off"):
        return None
    return "lanes" if value == "lanes" else "blocks"


def is_compressed(module: nn.Module) -> bool:
    """A Linear compressed-tensors left compressed (a `quantization_scheme` and a `weight_packed`)."""
    return hasattr(module, "quantization_scheme") and isinstance(
        getattr(module, "weight_packed", None), torch.Tensor
    )


def compressed_reason(module: Any) -> str | None:
    """Why `module` (a compressed Linear) cannot be kept in blocks, or None."""
    if type(module) is not nn.Linear:
        return f"a {type(module).__name__}, not an nn.Linear"
    args = getattr(module.quantization_scheme, "weights", None)
    if args is None or getattr(module.quantization_scheme, "input_activations", None) is not None:
        return "not weight-only"
    packed: torch.Tensor = getattr(module, "weight_packed")  # noqa: B009 (a module's attribute: any type)
    scale = getattr(module, "weight_scale", None)
    rows, columns = _shape(module)
    strategy = str(getattr(args.strategy, "value", args.strategy))
    if str(getattr(args.type, "value", args.type)) != "int" or args.num_bits not in QTYPE_OF_BITS:
        return f"{args.num_bits}-bit {args.type} values (int4 and int8 only)"
    if not args.symmetric or getattr(module, "weight_zero_point", None) is not None:
        return "asymmetric (zero points)"
    if getattr(module, "weight_g_idx", None) is not None or args.actorder is not None:
        return "activation-ordered groups"
    if strategy not in ("group", "channel", "tensor"):
        return f"the {strategy} strategy"
    if not isinstance(scale, torch.Tensor) or scale.dtype not in COMPUTE_DTYPES:
        return "no float32 / bfloat16 weight_scale"
    if (
        packed.dtype != torch.int32
        or packed.device.type != "cpu"
        or tuple(packed.shape)
        != (
            rows,
            columns * args.num_bits // 32,
        )
    ):
        return f"weight_packed {tuple(packed.shape)} {packed.dtype} is not the packed int32 words of [{rows}, {columns}]"
    group = columns if strategy != "group" else args.group_size
    if columns % BLOCK_WEIGHTS or group % BLOCK_WEIGHTS or columns % group:
        return f"groups of {group} over {columns} inputs are not whole blocks of {BLOCK_WEIGHTS}"
    if scale.numel() not in (1, rows * (columns // group)):
        return f"weight_scale {tuple(scale.shape)} does not match groups of {group}"
    return None


def _shape(module: Any) -> tuple[int, int]:
    shape = getattr(module, "weight_shape", None)
    if isinstance(shape, torch.Tensor) and shape.numel() == 2:
        return int(shape[0]), int(shape[1])
    return module.out_features, module.in_features


def compressed_blocks(module: Any) -> tuple[torch.Tensor, int] | str:
    """`module`'s weight as GGUF blocks and their type, or why not (`compressed_reason`, or scales that are
    not float16 values)."""
    reason = compressed_reason(module)
    if reason is not None:
        return reason
    bits = module.quantization_scheme.weights.num_bits
    rows, columns = _shape(module)
    words = module.weight_packed.detach().contiguous().view(torch.uint8)  # value i at bit i * bits
    if bits == 4:
        stored = torch.stack((words & 15, words >> 4), dim=-1).reshape(rows, columns)
    else:
        stored = words.reshape(rows, columns)
    values = stored.to(torch.int16) - (1 << (bits - 1))  # stored as q + 2^(bits - 1)
    return blocks_from_values(values, module.weight_scale.detach(), bits)


def keep_compressed(model: nn.Module, lanes: bool = False) -> KeptCompressed:
    """Replace each compressed Linear of `model` that `compressed_blocks` takes by a `QuantizedLinear` over its
    blocks (the compressed parts dropped), then, with `lanes`, repack a bfloat16 model's over lanes (faster,
    but its product does not round the weights to bfloat16 as the decompressed model does)."""
    report = KeptCompressed()
    for name, module in list(model.named_modules()):
        if not is_compressed(module):
            continue
        converted = compressed_blocks(module)
        if isinstance(converted, str):
            report.left[name] = converted
            continue
        blocks, qtype = converted
        bias: Any = module.bias
        replacement = QuantizedLinear(blocks, qtype, _shape(module)[1], bias, module.weight_scale.dtype)
        replacement.train(module.training)
        model.set_submodule(name, replacement)
        report.kept.append(name)
    if lanes and report.kept:
        report.lanes = repack_lanes(model)
    report.quantized_bytes = quantized_bytes(model)
    return report


def keep_pending_compressed(model: nn.Module) -> KeptCompressed | None:
    """Before a compressed checkpoint's pending decompression (engine/weights/pending_decompression.py): keep
    what can stay compressed, where that is switched on and the native library (its products) is loaded;
    None when nothing was tried."""
    mode = keep_compressed_mode()
    if mode is None or native_module() is None:
        return None
    if not any(is_compressed(module) for module in model.modules()):
        return None
    report = keep_compressed(model, lanes=mode == "lanes")
    logger.info(
        "compressed-tensors checkpoint: %d Linears kept compressed (%d bytes of blocks), %d decompressed%s",
        len(report.kept),
        report.quantized_bytes,
        len(report.left),
        f" ({sorted(set(report.left.values()))})" if report.left else "",
    )
    return report
