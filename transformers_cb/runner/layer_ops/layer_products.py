"""A layer's products as its projections' forwards would run them, for the native decoder layer's call
(runner/layer_ops/layer_plan.py keeps them per row count): each projection (a plain or packed `nn.Linear`, a
GGUF model's `QuantizedLinear`, a torchao Intx Linear's blocks) read from its owner (`projections_of`), and
its product as the forward would pick it (packed or `F.linear` by the row rule, the fused group, the
small-row product, the blocks' native product: `ProductSpecs`, `add_products`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

import torch
from torch import nn

from ..products.packed_linear import PACKS, Pack
from ..products.packed_model import PackedProduct, packed_product_of
from ..products.quantized_linear import QuantizedLinear, takes_direct
from ..products.small_rows import row_pack_for
from ..products.torchao_linear import IntxBlocks, intx_blocks_for
from .layer_forms import has_hooks, plain_tensor


def hooked(module: nn.Module) -> bool:
    """Hooks that `nn.Module.__call__` would run (the direct step skips it)."""
    return has_hooks(module) or bool(module._backward_hooks or module._backward_pre_hooks)


def plain_cpu(tensor: torch.Tensor, dtype: torch.dtype) -> bool:
    return plain_tensor(tensor) and tensor.is_cpu and tensor.dtype == dtype


# A projection as this call will run it: (module, its packed product, or the GGUF blocks a torchao Intx
# Linear's run forward reads, or None for a plain or quantized Linear).
Projection = tuple[nn.Linear | QuantizedLinear, PackedProduct | IntxBlocks | None]


def _quantized(module: QuantizedLinear, dtype: torch.dtype, rows: int) -> bool:
    """Whether `module`'s forward runs the native product over its blocks on `rows` rows of `dtype`
    (`quantized_product`'s rule; beyond it the dequantized tiles' path, which the modules' forwards take)."""
    blocks, bias = module._buffers["blocks"], module._parameters.get("bias")
    return (
        "forward" not in module.__dict__
        and not hooked(module)
        and takes_direct(module.kernel_qtype, dtype, rows)
        and blocks is not None
        and plain_tensor(blocks)
        and blocks.is_cpu
        and blocks.is_contiguous()
        and (bias is None or (plain_tensor(bias) and bias.is_cpu))
    )


def projections_of(
    owner: nn.Module, names: Sequence[str], dtype: torch.dtype, rows: int
) -> list[Projection] | None:
    """`owner`'s projections if each is a plain `nn.Linear` of `dtype` with no hooks, whose forward is the
    class's or the run's packed one, or a `QuantizedLinear` whose forward runs the native product on `rows`."""
    found: list[Projection] = []
    for name in names:
        module = owner._modules.get(name)
        if type(module) is QuantizedLinear:
            if not _quantized(module, dtype, rows):
                return None
            found.append((module, None))
            continue
        if type(module) is not nn.Linear or hooked(module):
            return None
        blocks = intx_blocks_for(module, dtype, rows)
        if blocks is not None:
            found.append((module, blocks))
            continue
        weight, bias = module._parameters["weight"], module._parameters["bias"]
        # plain CPU tensors only: a DTensor or another subclass keeps its own dispatch (the modules' path)
        if (
            weight is None
            or not plain_cpu(weight, dtype)
            or (bias is not None and not plain_cpu(bias, dtype))
        ):
            return None
        packed = packed_product_of(module)
        if packed is None and "forward" in module.__dict__:
            return None
        found.append((module, packed))
    return found


@dataclass
class ProductSpecs:
    """The products of one layer step as the native call takes them (attention/native/native_decoder_source.py):
    per product its kind (0 `linear` on the weight, 1 oneDNN's on its pack, 2 the small-row product on its
    row pack, 3 `QuantizedLinear`'s native product on its blocks), that tensor, its bias, its width and its
    GGUF type (0 but for kind 3)."""

    kinds: list[int] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)
    biases: list[torch.Tensor | None] = field(default_factory=list)
    outs: list[int] = field(default_factory=list)
    qtypes: list[int] = field(default_factory=list)
    # per product, the pack (and its handle in `PACKS`) its tensor comes from, or None
    packs: list[tuple[int, Pack] | None] = field(default_factory=list)

    def add(
        self,
        kind: int,
        tensor: torch.Tensor,
        bias: torch.Tensor | None,
        out_features: int,
        qtype: int = 0,
        pack: tuple[int, Pack] | None = None,
    ) -> None:
        self.kinds.append(kind)
        self.tensors.append(tensor)
        self.biases.append(bias)
        self.outs.append(out_features)
        self.qtypes.append(qtype)
        self.packs.append(pack)

    def add_pack(
        self, handle: int, pack: Pack, bias: torch.Tensor | None, dtype: torch.dtype, rows: int
    ) -> None:
        """oneDNN's product on `pack`, or the small-row product where `packed_linear.product` takes it."""
        # a bf16 weight packed in float32 (packed_linear.pack_dtype) runs the float32 products, widened
        rows_pack = row_pack_for(pack, pack.packed.dtype, rows)
        out_features = pack.packed.shape[0]
        tensor = pack.packed if rows_pack is None else rows_pack
        self.add(1 if rows_pack is None else 2, tensor, bias, out_features, pack=(handle, pack))


def _add_single(specs: ProductSpecs, projection: Projection, dtype: torch.dtype, rows: int) -> None:
    """What the projection's forward computes: `packed_model._packed_forward`'s choice, or F.linear (or a
    quantized Linear's product over its blocks)."""
    module, packed = projection
    if isinstance(module, QuantizedLinear):
        blocks = cast(torch.Tensor, module._buffers["blocks"])  # `_quantized` saw the blocks
        specs.add(3, blocks, module._parameters.get("bias"), module.out_features, module.kernel_qtype)
        return
    if isinstance(packed, IntxBlocks):
        specs.add(3, packed.blocks, module._parameters["bias"], module.out_features, packed.qtype)
        return
    params = module._parameters  # what `module.weight` reads, without `nn.Module.__getattr__`
    weight, bias = cast(torch.Tensor, params["weight"]), params["bias"]  # `_projections` saw the weight
    if packed is None or rows < packed.min_rows or weight.is_inference():
        specs.add(0, weight, bias, module.out_features)
    else:
        specs.add_pack(packed.handle, PACKS.current(packed.handle, weight), bias, dtype, rows)


def add_products(
    specs: ProductSpecs, projections: list[Projection], dtype: torch.dtype, rows: int
) -> tuple[int, list[int]]:
    """The products of projections that read one input: their fused group's product (to be split at the
    returned widths), when they are that whole group in order and it runs packed at this row count (what
    the first member's forward computes, handing the others their columns), else each its own. Returns
    (how many products, the split)."""
    first = projections[0][1]
    group = first.group if isinstance(first, PackedProduct) else None
    if (
        group is not None
        and isinstance(first, PackedProduct)
        and not group.unfused
        and rows >= first.min_rows
        and len(group.members) == len(projections)
        and all(m is p[0] for m, p in zip(group.members, projections, strict=True))
    ):
        pack = group.pack()
        specs.add_pack(group.handle, pack, pack.bias, dtype, rows)
        return 1, list(group.out_features)
    for projection in projections:
        _add_single(specs, projection, dtype, rows)
    return len(projections), []
