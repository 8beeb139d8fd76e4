"""torchao weight-only Linears on native products for the run (int8 on `int8_matmul`, Intx as GGUF blocks); real bytes of quantized weights.

A model quantized by torchao (`quantize_(model, Int8WeightOnlyConfig())`, or transformers'
`TorchAoConfig(Int8WeightOnlyConfig())` at `from_pretrained`) keeps its `nn.Linear` modules with a tensor
subclass as weight (`torchao.quantization.Int8Tensor`: int8 `qdata` [N, K], float32 `scale` per row). On the
CPU torchao's product widens the whole int8 weight to x's dtype at each call, then runs torch's `mm` and
multiplies by the scale. `int8_linears(model, enabled)` (entered by `Engine.session()` beside the packed
products) gives each such Linear an instance `forward` that runs the native library's `int8_matmul`
(attention/native/quantized/native_int8_source.py) on up to `DIRECT_MAX_ROWS` rows: it reads the int8 rows in place (no
copy, so no pack bytes), sums in float32 and rounds where torchao rounds (the sum in x's dtype, then the
product with the scale, then the bias), so it differs from torchao's result only by the order of the
float32 sums. Beyond those rows (prefill), under autograd, in a compiled forward, and for every weight this
module does not take (`native_reason`), torchao's own product runs (`F.linear` on the subclass).

torchao's int4 weight-only on the CPU is `IntxWeightOnlyConfig` (`IntxUnpackedToInt8Tensor`: one int8 a
value, a scale and zero point per group), whose product dequantizes the whole weight in x's dtype at each
call and runs `F.linear`. A symmetric one (zero points 0) with groups of whole blocks and float16-valued
scales (a bfloat16 model's) is GGUF blocks (runner/products/gguf_blocks.py): `prepare_intx_blocks` writes
them once per weight, when the engine's settings are resolved (before the KV cache is sized, so it sees
their memory; `intx_missing_bytes` is checked against the room as packed copies are), and the run's forward
reads them with the native product on few rows (`quantized_product`, whose bfloat16 product rounds each
weight to bfloat16 as torchao's dequantization does); torchao's own product beyond.

The reference of such a model is `generate()` on the same torchao model (docs/quantization.md). torchao
itself is never imported here: a weight is recognized by its class's name and module.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import TypeGuard

import torch
import torch.nn.functional as F
from torch import nn

from ...attention.native.kernel import native_module
from ...memory.weight_key import quantized_parts
from ...patches import in_force, patched
from .gguf_blocks import QTYPE_OF_BITS, blocks_from_values
from .quantized_linear import quantized_product, row_bytes, takes_direct

PATCH_KIND = "torchao_linears"  # its counted patches (patches.py)
COMPUTE_DTYPES = (torch.float32, torch.bfloat16)
# Up to this many rows the native product runs; beyond, torchao's (its `mm` on the widened weight). The
# bounds of the GGUF blocks' product (runner/products/quantized_linear.py, measured there): not measured for int8
# rows yet, which widen more cheaply than nibbles.
DIRECT_MAX_ROWS = {torch.float32: 16, torch.bfloat16: 8}
_lock = threading.Lock()


def is_torchao_tensor(tensor: torch.Tensor) -> bool:
    """A torchao tensor subclass (any of its quantized weights)."""
    return type(tensor).__module__.split(".")[0] == "torchao"


def native_reason(weight: torch.Tensor) -> str | None:
    """Why `weight` cannot run on `int8_matmul`, or None: a torchao `Int8Tensor` on the CPU, weight-only
    (no activation quantization or pre-scale), with one scale per row or for the whole tensor (torchao's
    own int8 branch; a per-group weight is dequantized by torchao instead), in float32 or bfloat16."""
    if not is_torchao_tensor(weight) or type(weight).__name__ != "Int8Tensor":
        return "not a torchao Int8Tensor"
    if (
        getattr(weight, "act_quant_kwargs", None) is not None
        or getattr(weight, "act_pre_scale", None) is not None
    ):
        return "activations are quantized or pre-scaled (not weight-only)"
    qdata, scale = getattr(weight, "qdata", None), getattr(weight, "scale", None)
    if not isinstance(qdata, torch.Tensor) or not isinstance(scale, torch.Tensor):
        return "no qdata / scale"
    if (
        qdata.dtype != torch.int8
        or qdata.dim() != 2
        or not qdata.is_contiguous()
        or qdata.device.type != "cpu"
    ):
        return "qdata is not a contiguous 2-D int8 CPU tensor"
    if weight.dtype not in COMPUTE_DTYPES:
        return f"its dtype is {weight.dtype} (float32 and bfloat16 only)"
    if list(getattr(weight, "block_size", (0,)))[-1] < qdata.shape[-1] or scale.numel() not in (
        1,
        qdata.shape[0],
    ):
        return "per-group scales (torchao dequantizes those)"
    return None


def is_plain_linear(module: nn.Module) -> TypeGuard[nn.Linear]:
    """A plain `nn.Linear`: not a subclass, no accelerate hook, no forward of its own set by someone else."""
    if type(module) is not nn.Linear or hasattr(module, "_hf_hook"):
        return False
    return "forward" not in module.__dict__ or in_force(PATCH_KIND, module, "forward")


def is_native_int8(module: nn.Module) -> TypeGuard[nn.Linear]:
    """A plain `nn.Linear` whose weight `int8_matmul` can run."""
    return is_plain_linear(module) and native_reason(module.weight) is None


def int8_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """`F.linear(x, weight, bias)` for an `Int8Tensor` weight on the native library, or None when it is not
    loaded (not built yet, switched off) or predates `int8_matmul`."""
    module = native_module()
    if module is None or not hasattr(module, "int8_matmul"):
        return None
    qdata: torch.Tensor = weight.qdata  # type: ignore[attr-defined]
    scale = weight.scale.reshape(-1).float()  # type: ignore[attr-defined]
    out_features, in_features = qdata.shape
    if scale.numel() == 1:
        scale = scale.expand(out_features)
    y = module.int8_matmul(x.reshape(-1, in_features), qdata, scale.contiguous())
    if bias is not None:
        y += bias  # after the scale, in x's dtype: torchao's `y += bias`
    return y.reshape(*x.shape[:-1], out_features)


def _native_forward(module: nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(input: torch.Tensor) -> torch.Tensor:
        weight, bias = module.weight, module.bias
        plain = (
            torch.is_grad_enabled()
            or torch.compiler.is_compiling()
            or input.dtype != weight.dtype
            or input.device.type != "cpu"
            or input.numel() > DIRECT_MAX_ROWS[weight.dtype] * module.in_features
            or native_reason(weight) is not None  # replaced since the run began
        )
        output = None if plain else int8_product(input, weight, bias)
        return F.linear(input, weight, bias) if output is None else output

    return forward


INTX_BITS = {getattr(torch, f"int{bits}", None): bits for bits in range(1, 9)}


def intx_reason(weight: torch.Tensor) -> str | None:
    """Why `weight` cannot be GGUF blocks (before its values are looked at), or None: a torchao
    `IntxUnpackedToInt8Tensor` on the CPU, weight-only, of at most 8 bits, float32 or bfloat16, one scale a
    row or a group of whole blocks."""
    if not is_torchao_tensor(weight) or type(weight).__name__ != "IntxUnpackedToInt8Tensor":
        return "not a torchao IntxUnpackedToInt8Tensor"
    if getattr(weight, "activation_quantization", None) is not None:
        return "activations are quantized (not weight-only)"
    qdata = getattr(weight, "qdata", None)
    if not isinstance(qdata, torch.Tensor) or qdata.dtype != torch.int8 or qdata.dim() != 2 or qdata.is_cuda:
        return "qdata is not a 2-D int8 CPU tensor"
    if weight.dtype not in COMPUTE_DTYPES:
        return f"its dtype is {weight.dtype} (float32 and bfloat16 only)"
    if INTX_BITS.get(getattr(weight, "target_dtype", None)) is None:
        return f"target dtype {getattr(weight, 'target_dtype', None)}"
    if list(getattr(weight, "block_size", ()))[:1] != [1]:
        return f"block size {getattr(weight, 'block_size', None)} (one row a block only)"
    return None


@dataclass
class IntxBlocks:
    """The GGUF blocks of a torchao Intx weight, and what they were written from (replaced or rewritten
    since: stale)."""

    weight: torch.Tensor
    version: int
    blocks: torch.Tensor
    qtype: int

    def fresh(self, weight: torch.Tensor) -> bool:
        return weight is self.weight and weight.qdata._version == self.version  # type: ignore[attr-defined]


# module -> its blocks, for the model's life (a later run reuses them), or why it has none
_intx_blocks: weakref.WeakKeyDictionary[nn.Module, IntxBlocks | str] = weakref.WeakKeyDictionary()


def intx_linears(model: nn.Module) -> list[nn.Linear]:
    """The plain Linears of `model` whose weight `intx_reason` takes."""
    return [m for m in model.modules() if is_plain_linear(m) and intx_reason(m.weight) is None]


def _fresh_blocks(module: nn.Linear) -> IntxBlocks | None:
    """`module`'s blocks, where written from its weight as it is now."""
    entry = _intx_blocks.get(module)
    weight = module._parameters["weight"]
    return entry if isinstance(entry, IntxBlocks) and weight is not None and entry.fresh(weight) else None


def intx_missing_bytes(model: nn.Module) -> int:
    """Bytes the blocks of `model`'s Intx Linears not written yet (or stale) will take (an upper bound: a
    weight whose values turn out not to be blocks' takes none)."""
    missing = 0
    for module in intx_linears(model):
        if _fresh_blocks(module) is None:
            out_features, in_features = module.weight.shape
            qtype = QTYPE_OF_BITS[4 if INTX_BITS[module.weight.target_dtype] <= 4 else 8]  # type: ignore[attr-defined]
            missing += out_features * row_bytes(qtype, in_features)
    return missing


def prepare_intx_blocks(model: nn.Module) -> int:
    """Write the GGUF blocks of `model`'s Intx Linears that have none (or stale ones); how many Linears have
    blocks now. Those whose values are not blocks' (asymmetric, scales not float16 values) keep torchao's
    product."""
    ready = 0
    with _lock:
        for module in intx_linears(model):
            entry = _fresh_blocks(module) or _blocks_of(module.weight)
            _intx_blocks[module] = entry
            ready += isinstance(entry, IntxBlocks)
    return ready


def _blocks_of(weight: torch.Tensor) -> IntxBlocks | str:
    qdata: torch.Tensor = weight.qdata  # type: ignore[attr-defined]
    zero_point = getattr(weight, "zero_point", None)
    if isinstance(zero_point, torch.Tensor) and bool((zero_point != 0).any()):
        return "asymmetric (zero points)"
    bits = INTX_BITS[weight.target_dtype]  # type: ignore[attr-defined]
    converted = blocks_from_values(qdata, weight.scale.detach(), 4 if bits <= 4 else 8)  # type: ignore[attr-defined]
    if isinstance(converted, str):
        return converted
    blocks, qtype = converted
    return IntxBlocks(weight, qdata._version, blocks, qtype)


def intx_blocks_for(module: nn.Linear, dtype: torch.dtype, rows: int) -> IntxBlocks | None:
    """The blocks `module`'s run forward reads for `rows` rows of `dtype` (the native decoder layer runs the
    same product on them), or None where that forward is not in force or would run torchao's product."""
    entry = _fresh_blocks(module)
    if (
        entry is None
        or not in_force(PATCH_KIND, module, "forward")
        or entry.weight.dtype != dtype
        or not takes_direct(entry.qtype, dtype, rows)
    ):
        return None
    return entry


def _intx_forward(module: nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(input: torch.Tensor) -> torch.Tensor:
        bias = module.bias
        rows = input.numel() // module.in_features
        entry = intx_blocks_for(module, input.dtype, rows)
        if (
            entry is None
            or torch.is_grad_enabled()
            or torch.compiler.is_compiling()
            or input.device.type != "cpu"
            or native_module() is None
        ):
            return F.linear(input, module.weight, bias)
        output = quantized_product(input.reshape(rows, module.in_features), entry.blocks, entry.qtype)
        if bias is not None:
            output += bias
        return output.reshape(*input.shape[:-1], module.out_features)

    return forward


@contextmanager
def torchao_linears(model: nn.Module, enabled: bool) -> Iterator[int]:
    """Inside (with `enabled`): the torchao int8 weight-only Linears of `model` run `int8_matmul` on few rows,
    the Intx ones with blocks (`prepare_intx_blocks`) the GGUF blocks' native product. Yields how many
    Linears."""
    if not enabled:
        yield 0
        return
    with _lock:
        forwards = [(m, "forward", partial(_native_forward, m)) for m in model.modules() if is_native_int8(m)]
        forwards += [
            (m, "forward", partial(_intx_forward, m))
            for m in intx_linears(model)
            if isinstance(_intx_blocks.get(m), IntxBlocks)
        ]
    with patched(PATCH_KIND, forwards) as count:
        yield count


def intx_block_bytes(model: nn.Module) -> int:
    """Bytes of the GGUF blocks written for `model`'s Intx Linears (fresh ones)."""
    return sum(entry.blocks.numel() for m in intx_linears(model) if (entry := _fresh_blocks(m)) is not None)


def tensor_bytes(tensor: torch.Tensor) -> int:
    """The bytes `tensor` holds: a torchao weight (whose `numel() * element_size()` counts the logical float
    weight) by the plain tensors it is made of (`quantized_parts`)."""
    return sum(part.numel() * part.element_size() for part in quantized_parts(tensor))


def torchao_bytes(model: nn.Module) -> int:
    """Bytes of `model`'s torchao-quantized parameters as held (int8 data and scales), shared ones once."""
    seen: dict[int, int] = {}
    for parameter in model.parameters():
        if is_torchao_tensor(parameter):
            seen.setdefault(id(parameter), tensor_bytes(parameter))
    return sum(seen.values())
