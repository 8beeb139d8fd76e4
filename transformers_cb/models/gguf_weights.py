"""Keeping a GGUF model's weights quantized: its Q4_0 / Q4_1 / Q8_0 Linears (and a quantized, tied token
embedding) put back into their GGUF blocks after transformers loaded them dequantized.

`keep_gguf_quantized(model, gguf_file)` reads the file's raw blocks (`raw_tensors`), names each tensor as
transformers does (gguf's tensor name map, as `get_gguf_hf_weights_map`, and the architecture's tensor
processor: a Llama's q/k rows are permuted on load, and since a block runs along K, within one row, the
same row permutation applies to the blocks), and replaces each `nn.Linear` whose blocks dequantize *exactly* to the weight transformers
loaded (float32, or that rounded to the model's bfloat16) by a `QuantizedLinear` (runner/products/quantized_linear.py);
the float weights are dropped. A tensor that does not check out (another processor's transform, a shape
that is not whole blocks, an F16 tensor) stays float, with the reason in the report. A tied embedding and LM
head (the real model's Q8_0 `token_embd`) share one blocks tensor: a `QuantizedEmbedding` and a
`QuantizedLinear`.

Where the file is: transformers records it on the model (`config.quantization_config.gguf_file`, its
`GgufConfig`) when loaded with `from_pretrained(folder, gguf_file=...)`; a converted folder
(models/fetch.py) names it in its `transformers_cb_source.json` (`gguf_of_folder`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from ..runner.products.quantized_linear import (
    BLOCK_BYTES,
    BLOCK_WEIGHTS,
    QuantizedEmbedding,
    QuantizedLinear,
    dequantize_blocks,
    quantized_bytes,
    repack_lanes,
    row_bytes,
)

#: The provenance file of a converted folder (models/fetch.py writes it) and its key naming the GGUF kept there.
PROVENANCE = "transformers_cb_source.json"
GGUF_KEY = "gguf_file"


@dataclass
class KeptQuantized:
    """What `keep_gguf_quantized` did: the modules now in blocks, those left float and why, the bytes."""

    gguf_file: str
    quantized: list[str] = field(default_factory=list)
    left_float: dict[str, str] = field(default_factory=dict)
    quantized_bytes: int = 0
    float_bytes_dropped: int = 0
    # the modules repacked over lanes (`repack_over_lanes`: a bfloat16 model's, a tied embedding with its head)
    lanes: list[str] = field(default_factory=list)


def gguf_file_of(model: nn.Module) -> str | None:
    """The GGUF file transformers loaded `model` from, or None: `GgufConfig.gguf_file` as given to
    `from_pretrained` (a name inside the model's folder, `name_or_path`, or a path)."""
    model_config = getattr(model, "config", None)
    config = getattr(model_config, "quantization_config", None)
    found = config.get("gguf_file") if isinstance(config, dict) else getattr(config, "gguf_file", None)
    if not found:
        return None
    folder = getattr(model_config, "_name_or_path", None) or getattr(model, "name_or_path", None)
    if not Path(found).is_file() and folder and (Path(folder) / found).is_file():
        return str(Path(folder) / found)
    return str(found)


def gguf_of_folder(folder: str | Path) -> Path | None:
    """The GGUF a converted folder keeps beside its float weights (named in its provenance file), or None."""
    record = Path(folder) / PROVENANCE
    try:
        name = json.loads(record.read_text(encoding="utf-8")).get(GGUF_KEY)
    except (OSError, ValueError):
        return None
    path = Path(folder) / name if isinstance(name, str) and name else None
    return path if path is not None and path.is_file() else None


def keep_gguf_quantized(
    model: nn.Module, gguf_file: str | Path | None = None, lanes: bool = True
) -> KeptQuantized:
    """Replace `model`'s Linears (and a tied quantized embedding) by their GGUF blocks from `gguf_file`
    (default: the file transformers recorded, `gguf_file_of`), then, with `lanes`, repack those the lane
    product serves (`repack_over_lanes`). Raises `ValueError` when there is no file."""
    path = gguf_file if gguf_file is not None else gguf_file_of(model)
    if path is None:
        raise ValueError("keep_gguf_quantized: the model names no GGUF file; pass gguf_file=")
    report = KeptQuantized(gguf_file=str(path))
    architecture, tensors = raw_tensors(str(path))
    dropped: dict[int, int] = {}
    owners = _weight_owners(model)
    for hf_name, qtype, blocks in _named_blocks(model, architecture, tensors):
        for module_name in _modules_of(model, hf_name, owners):
            reason = _replace(model, module_name, torch.from_numpy(blocks), qtype, dropped)
            if reason is None:
                report.quantized.append(module_name)
            else:
                report.left_float[module_name] = reason
    if lanes:
        report.lanes = repack_lanes(model)
    report.quantized_bytes = quantized_bytes(model)
    report.float_bytes_dropped = sum(dropped.values())
    return report


def raw_tensors(path: str) -> tuple[str, list[tuple[str, int, np.ndarray]]]:
    """The file's architecture and its 2-D tensors of the kept types: (GGUF name, GGML type, blocks
    `[rows, row bytes]`, a read-only view of the mapped file). transformers' header reader skips the
    tokenizer's string arrays (~1 s for the real model); `gguf.GGUFReader` parses them (~10 s) where
    transformers has no such reader."""
    try:
        from transformers.integrations.gguf.reader import GgufHeader, load_gguf_state_dict
    except ImportError:
        import gguf

        reader = gguf.GGUFReader(path)
        field_ = reader.fields["general.architecture"]
        architecture = bytes(field_.parts[field_.data[0]]).decode()
        return architecture, [
            (t.name, int(t.tensor_type), np.asarray(t.data))
            for t in reader.tensors
            if int(t.tensor_type) in BLOCK_BYTES and np.asarray(t.data).ndim == 2
        ]
    header = GgufHeader.from_file(path)
    lazy = load_gguf_state_dict(header)
    found = []
    for info in header.tensors:
        if info.ggml_type in BLOCK_BYTES and len(info.shape) == 2:
            rows, columns = info.shape
            found.append((info.name, info.ggml_type, lazy[info.name].data.reshape(rows, -1)))
    return header.architecture, found


def _named_blocks(
    model: nn.Module, architecture: str, tensors: list[tuple[str, int, np.ndarray]]
) -> list[tuple[str, int, np.ndarray]]:
    """(transformers parameter name, GGML type, blocks with the rows as transformers' tensor processor
    orders them, an owned copy) for each tensor named as `get_gguf_hf_weights_map` names it at the top
    level (its per-submodule pass, for checkpoints converted from a base model such as Bloom's, is left
    out: those tensors stay float)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    config = cast(Any, model).config
    arch = next((key for key, value in MODEL_ARCH_NAMES.items() if value == architecture), None)
    if arch is None:
        return []
    name_map = get_tensor_name_map(arch, config.num_hidden_layers)
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.to_dict())
    mapping: dict[str, str] = {}
    for hf_name in model.state_dict():
        stem, dot, suffix = processor.preprocess_name(hf_name).rpartition(".")
        gguf_name = name_map.get_name(stem) if dot and suffix in ("weight", "bias") else None
        if gguf_name is not None:
            mapping.setdefault(f"{gguf_name}.{suffix}", hf_name)
    named = []
    for name, qtype, blocks in tensors:
        try:
            result = processor.process(
                weights=blocks,
                name=name,
                tensor_key_mapping=mapping,
                parsed_parameters={"config": config.to_dict(), "tensors": {}},
            )
        except Exception:  # noqa: BLE001 - a transform the blocks cannot take: the tensor stays float
            continue
        if result.name in mapping:
            named.append((mapping[result.name], qtype, np.array(result.weights, copy=True)))
    return named


def _weight_owners(model: nn.Module) -> dict[int, list[str]]:
    """The modules holding each weight tensor, by the tensor's id: a tied LM head shares the embedding's
    (transformers' state dict names only one of them)."""
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor):
            owners.setdefault(id(weight), []).append(name)
    return owners


def _modules_of(model: nn.Module, hf_name: str, owners: dict[int, list[str]]) -> list[str]:
    """The module holding parameter `hf_name` first, then every other module tied to the same tensor."""
    owner = hf_name.removesuffix(".weight")
    try:
        weight = model.get_submodule(owner).weight
    except AttributeError:
        return []
    return [owner, *(name for name in owners.get(id(weight), []) if name != owner)]


def _replace(
    model: nn.Module, name: str, blocks: torch.Tensor, qtype: int, dropped: dict[int, int]
) -> str | None:
    """Put `blocks` in place of module `name`'s weight; None when done, else why it stays float."""
    module = model.get_submodule(name)
    if type(module) not in (nn.Linear, nn.Embedding):
        return f"a {type(module).__name__}, not an nn.Linear or nn.Embedding"
    weight = cast(torch.Tensor, module.weight)
    rows, columns = weight.shape
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return f"its weight is {weight.dtype} on {weight.device} (float32 / bfloat16 on the CPU only)"
    if columns % BLOCK_WEIGHTS or tuple(blocks.shape) != (rows, row_bytes(qtype, columns)):
        return f"blocks {tuple(blocks.shape)} do not hold its [{rows}, {columns}] weight"
    if not torch.equal(dequantize_blocks(blocks, qtype, weight.dtype), weight.detach()):
        return "its blocks do not dequantize to the weight transformers loaded"
    replacement: nn.Module
    if isinstance(module, nn.Embedding):
        replacement = QuantizedEmbedding(blocks, qtype, columns, weight.dtype, module.padding_idx)
    else:
        replacement = QuantizedLinear(
            blocks, qtype, columns, cast(torch.Tensor | None, module.bias), weight.dtype
        )
    replacement.train(module.training)
    model.set_submodule(name, replacement)
    dropped[weight.data_ptr()] = weight.numel() * weight.element_size()
    return None
