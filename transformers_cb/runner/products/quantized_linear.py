"""Linears and embeddings whose weights stay in GGUF blocks (Q4_0, Q4_1, Q8_0): `QuantizedLinear`,
`QuantizedEmbedding` and the product they run, `quantized_product`.

A decode step reads every weight once and is bound by memory bandwidth on a CPU: 4-bit blocks (0.56-0.63
bytes a weight) are read 6-7x faster than float32 ones. The native library's `quant_matmul`
(attention/native/quantized/native_quant_source.py) dequantizes each block in registers and multiplies in float32, for the
few rows of a decode step; from `DIRECT_MAX_ROWS` rows on (prefill) tiles of the weight are dequantized
(`quant_dequantize`) and multiplied by torch's product, faster there (docs/quantization.md has the
measurements). Without the native library (not built yet, or switched off) the blocks are dequantized by
torch ops (`dequantize_blocks`): the same values, slower.

A bfloat16 model's Linears (and a tied embedding with its LM head) are repacked over lanes
(`repack_over_lanes`, the native library's `quant_lanes_pack`, attention/native/quantized/native_lanes_source.py):
16 columns' blocks side by side, the same bytes, read by a product that has no per-block table to build
(`LANES + qtype`, the kernel's type).

These modules replace a model's `nn.Linear` / `nn.Embedding` for good (models/gguf_weights.py, at load):
the float weights are not kept, so `generate()` and every engine step run the same products. They are no
`nn.Linear` (packing, runner/products/packed_model.py, leaves them alone) and their blocks are buffers, not
parameters (no gradient, no optimizer).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...attention.native.kernel import native_module

Q4_0, Q4_1, Q8_0 = 2, 3, 8  # GGML type ids (gguf.GGMLQuantizationType)
# A lane layout's type is LANES + its GGUF type (Q4_0: 102, Q4_1: 103, Q8_0: 108); 16 columns a lane group.
LANES = 100
LANE_COLUMNS = 16
BLOCK_WEIGHTS = 32
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}
QUANT_NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0"}
COMPUTE_DTYPES = (torch.float32, torch.bfloat16)
# Up to this many rows the native product reads the blocks directly; beyond, tiles of the dequantized weight
# go through torch's product (measured against those tiles, docs/quantization.md: the direct product is
# faster up to 16 rows in float32, up to ~8 in bfloat16, where oneDNN's AMX product of the tiles catches up).
DIRECT_MAX_ROWS = {torch.float32: 16, torch.bfloat16: 8}
# Weights dequantized per tile on the prefill path: a few MB, never the whole weight at once.
TILE_ELEMENTS = 1 << 20


def row_bytes(qtype: int, in_features: int) -> int:
    """Bytes of one row of `in_features` weights in blocks of `qtype`."""
    return in_features // BLOCK_WEIGHTS * BLOCK_BYTES[qtype]


def takes_direct(qtype: int, dtype: torch.dtype, rows: int) -> bool:
    """Whether `rows` rows of `dtype` run the native product over the blocks of kernel type `qtype` (a GGUF
    type, or a lane layout's), not the dequantized tiles."""
    if qtype > LANES:  # at any row count as fast as the tiles or faster (docs/quantization.md)
        return dtype == torch.bfloat16
    return dtype in DIRECT_MAX_ROWS and rows <= DIRECT_MAX_ROWS[dtype]


def dequantize_blocks(blocks: torch.Tensor, qtype: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The `[N, K]` weight of `blocks` `[N, row bytes]` (of kernel type `qtype`) in `dtype`: the native
    dequantization when the library is loaded, else torch ops computing the same float32 values as
    `gguf.quants.dequantize`."""
    module = native_module()
    if module is not None and blocks.device.type == "cpu" and dtype in COMPUTE_DTYPES:
        return module.quant_dequantize(blocks, qtype, dtype)
    if qtype > LANES:
        blocks, qtype = _unpack_lanes_torch(blocks, qtype - LANES), qtype - LANES
    return _dequantize_torch(blocks, qtype).to(dtype)


def _dequantize_torch(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    rows = blocks.shape[0]
    per_block = blocks.reshape(rows, -1, BLOCK_BYTES[qtype])
    d = per_block[..., :2].contiguous().view(torch.float16).float()  # [N, B, 1]
    if qtype == Q8_0:
        q = per_block[..., 2:].contiguous().view(torch.int8).float()
        return (q * d).reshape(rows, -1)
    packed = per_block[..., 4:] if qtype == Q4_1 else per_block[..., 2:]
    nibbles = torch.cat([packed & 15, packed >> 4], dim=-1).float()  # weight j < 16: low nibble of byte j
    if qtype == Q4_1:
        m = per_block[..., 2:4].contiguous().view(torch.float16).float()
        return (d * nibbles + m).reshape(rows, -1)
    return (d * (nibbles - 8)).reshape(rows, -1)


def _unpack_lanes_torch(lanes: torch.Tensor, qtype: int) -> torch.Tensor:
    """GGUF blocks of `qtype` from their lane layout (native_lanes_source.py's `quant_lanes_unpack`, in torch
    ops)."""
    rows, nb = lanes.shape[0], lanes.shape[1] // BLOCK_BYTES[qtype]
    scale_bytes = 64 if qtype == Q4_1 else 32
    grouped = lanes.reshape(rows // LANE_COLUMNS, nb, -1)
    # scales: [groups, blocks, 16 columns, 2 bytes] -> [rows, blocks, 2 bytes] (m after d for Q4_1)
    scales = grouped[..., :scale_bytes].reshape(-1, nb, scale_bytes // 32, LANE_COLUMNS, 2)
    scales = scales.permute(0, 3, 1, 2, 4).reshape(rows, nb, scale_bytes // 16)
    if qtype == Q8_0:  # vector v, column c, half h, byte t: q ^ 0x80 of weight k = 4v + 2t + h
        values = grouped[..., scale_bytes:].reshape(-1, nb, 8, LANE_COLUMNS, 2, 2) ^ 0x80
        q8 = values.permute(0, 3, 1, 2, 5, 4).reshape(rows, nb, BLOCK_WEIGHTS)
        return torch.cat([scales, q8], dim=-1).reshape(rows, -1)
    # vector i, column c, half h, 2 bytes: one 16-bit word of 4 nibbles s (weight k = 8i + 2s + h)
    words = grouped[..., scale_bytes:].reshape(-1, nb, 4, LANE_COLUMNS, 2, 2).to(torch.int32)
    words = words[..., 0] | (words[..., 1] << 8)
    q = torch.stack([(words >> (4 * s)) & 15 for s in range(4)], dim=-1)  # [g, b, i, c, h, s]
    q = q.permute(0, 3, 1, 2, 5, 4).reshape(rows, nb, BLOCK_WEIGHTS)  # k = 8i + 2s + h
    packed = (q[..., : BLOCK_WEIGHTS // 2] | (q[..., BLOCK_WEIGHTS // 2 :] << 4)).to(torch.uint8)
    return torch.cat([scales, packed], dim=-1).reshape(rows, -1)


def lanes_rows(lanes: torch.Tensor, qtype: int, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of the weight held over lanes (kernel type `qtype`), dequantized to `dtype` `[*ids, K]`:
    an embedding's lookup in the blocks its tied LM head reads."""
    module = native_module()
    if module is not None and lanes.device.type == "cpu" and dtype in COMPUTE_DTYPES:
        return module.quant_lanes_rows(lanes, qtype, ids, dtype)
    flat, width = ids.reshape(-1), lanes.shape[1]
    groups = lanes.reshape(-1, LANE_COLUMNS * width).index_select(0, flat // LANE_COLUMNS)
    blocks = _unpack_lanes_torch(groups.reshape(-1, width), qtype - LANES)
    picked = blocks[torch.arange(flat.numel()) * LANE_COLUMNS + flat % LANE_COLUMNS]
    return _dequantize_torch(picked, qtype - LANES).to(dtype).reshape(*ids.shape, -1)


def can_go_over_lanes(module: QuantizedLinear | QuantizedEmbedding) -> bool:
    """Whether the lane product serves `module`: a bfloat16 model's blocks of a multiple of 16 columns (rows
    of an embedding), not repacked yet, on a CPU whose build of the native library has AVX512-BF16."""
    ops = native_module()
    return (
        module.kernel_qtype == module.qtype
        and module.compute_dtype == torch.bfloat16
        and module.blocks.shape[0] % LANE_COLUMNS == 0
        and module.blocks.device.type == "cpu"
        and ops is not None
        and ops.quant_lanes_available()
    )


def repack_over_lanes(readers: list[QuantizedLinear | QuantizedEmbedding]) -> bool:
    """Repack the blocks `readers` (every module reading them: a tied embedding and LM head) share over lanes,
    once for all of them; whether it did (only where each can read lanes)."""
    ops = native_module()
    if ops is None or not readers or not all(can_go_over_lanes(module) for module in readers):
        return False
    lanes = ops.quant_lanes_pack(readers[0].blocks, readers[0].qtype)
    for module in readers:
        module.blocks = lanes
        module.kernel_qtype = LANES + module.qtype
    return True


def repack_lanes(model: nn.Module) -> list[str]:
    """Repack over lanes the blocks of every quantized module the lane product serves, a tensor shared by a
    tied embedding and LM head once for both (`repack_over_lanes`); the names of the modules repacked."""
    readers: dict[int, list[tuple[str, QuantizedLinear | QuantizedEmbedding]]] = {}
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear | QuantizedEmbedding):
            readers.setdefault(module.blocks.data_ptr(), []).append((name, module))
    repacked: list[str] = []
    for shared in readers.values():
        if repack_over_lanes([module for _, module in shared]):
            repacked.extend(name for name, _ in shared)
    return repacked


def quantized_product(x: torch.Tensor, blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """`x [R, K] @ W.T` for W in `blocks`, in x's dtype, accumulated in float32."""
    module = native_module() if x.device.type == "cpu" else None
    if module is not None and takes_direct(qtype, x.dtype, x.shape[0]):
        return module.quant_matmul(x, blocks, qtype)
    out_features = blocks.shape[0]
    tile = max(1, TILE_ELEMENTS // max(1, x.shape[1]))
    if qtype > LANES:  # whole lane groups
        tile = max(LANE_COLUMNS, tile - tile % LANE_COLUMNS)
    if tile >= out_features:
        return F.linear(x, dequantize_blocks(blocks, qtype, x.dtype))
    out = x.new_empty((x.shape[0], out_features))
    for start in range(0, out_features, tile):
        weight = dequantize_blocks(blocks[start : start + tile], qtype, x.dtype)
        out[:, start : start + tile] = F.linear(x, weight)
    return out


class QuantizedLinear(nn.Module):
    """`nn.Linear`'s product with the weight in GGUF blocks (`blocks` `[out, row bytes]` uint8, a buffer: the
    GGUF layout, or its lane layout after `repack_over_lanes`; `kernel_qtype` says which)."""

    blocks: torch.Tensor

    def __init__(
        self,
        blocks: torch.Tensor,
        qtype: int,
        in_features: int,
        bias: torch.Tensor | None = None,
        compute_dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        # The dtype of the model it serves (what its input and output are; runner/layer_ops/layer_forms.py reads it).
        self.compute_dtype = compute_dtype
        if qtype not in BLOCK_BYTES or in_features % BLOCK_WEIGHTS:
            raise ValueError(f"GGUF type {qtype} with {in_features} inputs cannot be kept in blocks")
        if blocks.dtype != torch.uint8 or tuple(blocks.shape[1:]) != (row_bytes(qtype, in_features),):
            raise ValueError(f"blocks {tuple(blocks.shape)} {blocks.dtype} do not hold {in_features} inputs")
        self.qtype = qtype
        # what the native product is told the blocks are: `qtype`, or LANES + qtype once repacked
        self.kernel_qtype = qtype
        self.in_features = in_features
        self.out_features = blocks.shape[0]
        self.register_buffer("blocks", blocks.contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        flat = input.reshape(-1, self.in_features)
        out = quantized_product(flat, self.blocks, self.kernel_qtype)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.reshape(*input.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        lanes = ", lanes" if self.kernel_qtype > LANES else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"quant={QUANT_NAMES[self.qtype]}{lanes}, bias={self.bias is not None}"
        )


class QuantizedEmbedding(nn.Module):
    """`nn.Embedding` over GGUF blocks: the looked-up rows dequantized to `compute_dtype` (a tied LM head's blocks
    are the same tensor)."""

    blocks: torch.Tensor

    def __init__(
        self,
        blocks: torch.Tensor,
        qtype: int,
        embedding_dim: int,
        compute_dtype: torch.dtype,
        padding_idx: int | None = None,
    ):
        super().__init__()
        if blocks.dtype != torch.uint8 or tuple(blocks.shape[1:]) != (row_bytes(qtype, embedding_dim),):
            raise ValueError(
                f"blocks {tuple(blocks.shape)} {blocks.dtype} do not hold {embedding_dim} values"
            )
        self.qtype = qtype
        self.kernel_qtype = qtype  # LANES + qtype once repacked with its tied head (`repack_over_lanes`)
        self.num_embeddings = blocks.shape[0]
        self.embedding_dim = embedding_dim
        self.compute_dtype = compute_dtype
        self.padding_idx = padding_idx
        self.register_buffer("blocks", blocks.contiguous())

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.kernel_qtype > LANES:
            return lanes_rows(self.blocks, self.kernel_qtype, input, self.compute_dtype)
        rows = self.blocks.index_select(0, input.reshape(-1))
        values = dequantize_blocks(rows, self.qtype, self.compute_dtype)
        return values.reshape(*input.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        lanes = ", lanes" if self.kernel_qtype > LANES else ""
        return f"{self.num_embeddings}, {self.embedding_dim}, quant={QUANT_NAMES[self.qtype]}{lanes}"


def quantized_bytes(model: nn.Module) -> int:
    """Bytes of the GGUF blocks `model` holds (a tensor shared by a tied embedding and head counted once)."""
    seen: dict[int, int] = {}
    for module in model.modules():
        if isinstance(module, QuantizedLinear | QuantizedEmbedding):
            seen[module.blocks.data_ptr()] = module.blocks.numel()
    return sum(seen.values())
