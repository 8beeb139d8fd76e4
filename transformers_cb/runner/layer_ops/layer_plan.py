"""What a layer's direct step runs (runner/layer_ops/direct_layer.py): the layer's parts, and its products
decided as the projections' forwards would decide them, kept per row count.

`layer_parts` reads a recognised layer's modules once per run (`LayerParts`). `make_plan` decides, for one
row count and dtype, each projection's product as its forward would pick it (packed or `F.linear` by the row
rule, the fused group, the small-row product, a `QuantizedLinear`'s or a torchao Intx Linear's blocks:
`ProductSpecs`) and records everything it read to decide (`LayerPlan`); `plan_for` reuses a layer's plan
while all of that is unchanged (a few identity and version compares a call, instead of ~50-100 us of
Python), and decides again when anything changed: a weight written or replaced, a pack rebuilt or released,
a hook, a module or forward replaced. Outputs are the same either way: only the deciding is saved.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ...attention.paged import NATIVE_STEPS_MARK
from ...patches import in_force
from ..products.fused_products import FusedGroup
from ..products.packed_linear import PACKS, Pack
from ..products.packed_model import PackedProduct
from ..products.quantized_linear import QuantizedLinear
from ..products.torchao_linear import IntxBlocks, intx_blocks_for
from .layer_forms import (
    child,
    norm_eps,
    norm_form,
    plain_tensor,
    references,
    same_function,
)
from .layer_products import ProductSpecs, add_products, hooked, plain_cpu, projections_of

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")

MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LayerParts:
    """The modules of one recognised layer (read once: a module replaced later, a PEFT wrapper say, is
    seen by the per-call checks on the projections, which are read at each call)."""

    attention: nn.Module
    mlp: nn.Module
    input_norm: nn.Module
    post_norm: nn.Module
    act_fn: nn.Module
    input_eps: float
    post_eps: float
    input_gemma: bool
    post_gemma: bool
    head_dim: int
    layer_idx: int
    scaling: float
    # (rows, dtype) -> what `direct_step` decided for such a call, and what it read to decide (`LayerPlan`):
    # made again where any of it changed. One per run: the parts are read at a run's first call.
    plans: dict[tuple[int, torch.dtype], LayerPlan] = field(default_factory=dict, compare=False, hash=False)


def layer_parts(layer: nn.Module, kind: str) -> LayerParts | None:
    """`layer`'s parts if the layer, its attention, MLP, both norms and its modeling file's rotary all run the
    native layer ops of patch kind `kind` (decided once the run's patches are in force)."""
    attention, mlp = child(layer, "self_attn"), child(layer, "mlp")
    input_norm, post_norm = child(layer, "input_layernorm"), child(layer, "post_attention_layernorm")
    file = sys.modules.get(type(attention).__module__)
    head_dim, layer_idx = getattr(attention, "head_dim", None), getattr(attention, "layer_idx", None)
    scaling = getattr(attention, "scaling", None)
    if (
        file is None
        or not isinstance(scaling, float)
        or not isinstance(head_dim, int)
        or not isinstance(layer_idx, int)
        or not same_function(type(attention).forward, references().llama_attention)
        or "forward" in attention.__dict__
        or not all(in_force(kind, m, "forward") for m in (mlp, input_norm, post_norm))
        or not in_force(kind, file, "apply_rotary_pos_emb")
    ):
        return None
    # Their instance forwards are the run's patches: the forms read the classes.
    input_form = norm_form(input_norm, patched=True)
    post_form = norm_form(post_norm, patched=True)
    if input_form is None or post_form is None:
        return None
    return LayerParts(
        attention=attention,
        mlp=mlp,
        input_norm=input_norm,
        post_norm=post_norm,
        act_fn=child(mlp, "act_fn"),
        input_eps=norm_eps(input_norm),
        post_eps=norm_eps(post_norm),
        input_gemma=input_form == "gemma",
        post_gemma=post_form == "gemma",
        head_dim=head_dim,
        layer_idx=layer_idx,
        scaling=scaling,
    )


@dataclass
class LayerPlan:
    """What `direct_step` decided for one layer at one row count and dtype (the native call's weights and
    products), and everything it read to decide that, so that a later call checks those reads (a few
    identity and version compares) instead of deciding again (~50-100 us of Python a layer):

    - `slots`: (mapping, key, what it held): the projections in their owners, their instance forwards (the
      run's packed or torchao forward, whose product and row bound are fixed), their weights, biases and
      blocks, the norms' weights; `tensors`: (tensor, version, address) of those tensors (a write in place
      bumps the version; `.data =` moves the address);
    - `hooks`: the hook registries of the layer's modules and projections, which must stay empty (and
      accelerate's `_hf_hook` absent, in `slots`); `groups`: fused groups that must not be unfused;
      `qtypes`: quantized Linears' kernel types (a repack over lanes changes it with its blocks);
      `intx`: torchao Intx Linears and the blocks their run forward reads (`intx_blocks_for`);
    - `packs`: per product, the pack (weakly held: a released pack is not kept alive) and its handle, whose
      tensor is read from the pack at each call (`PACKS` must still hold that very pack).

    What a step decides (its metadata: an all-native step, the layer's group, the cache) is checked at each
    call, as before."""

    slots: tuple[tuple[dict[str, Any], str, object], ...]
    tensors: tuple[tuple[torch.Tensor, int, int], ...]
    # the hook registries of the layer's modules and projections (each must stay empty; accelerate's
    # `_hf_hook` is watched through `slots`)
    hooks: tuple[dict[Any, Any], ...]
    groups: tuple[FusedGroup, ...]
    qtypes: tuple[tuple[QuantizedLinear, int], ...]
    intx: tuple[tuple[nn.Linear, IntxBlocks], ...]
    packs: tuple[tuple[int, weakref.ref[Pack], int] | None, ...]
    specs: ProductSpecs
    input_weight: torch.Tensor
    post_weight: torch.Tensor
    qkv_count: int
    qkv_split: list[int]
    gate_up_count: int
    gate_up_split: list[int]
    tile_rows: int  # the native call's row tiles (`row_tile`)

    def current_tensors(self, dtype: torch.dtype, rows: int) -> list[torch.Tensor] | None:
        """The products' tensors for this call, or None where anything the plan read has changed."""
        for mapping, key, held in self.slots:
            if mapping.get(key) is not held:
                return None
        for tensor, version, address in self.tensors:  # inference tensors are not among them (no version)
            if tensor._version != version or tensor.data_ptr() != address:
                return None
        if any(self.hooks) or any(group.unfused for group in self.groups):
            return None
        if any(module.kernel_qtype != qtype for module, qtype in self.qtypes):
            return None
        if any(intx_blocks_for(module, dtype, rows) is not blocks for module, blocks in self.intx):
            return None
        tensors = list(self.specs.tensors)
        for index, source in enumerate(self.packs):
            if source is None:
                continue
            handle, reference, kind = source
            pack = reference()
            if pack is None or not PACKS.holds(handle, pack):
                return None
            current = pack.packed if kind == 1 else pack.rows_pack
            if current is None:
                return None
            tensors[index] = current
        return tensors


# A step's tokens run the native layer in tiles whose gate/up product output takes at most this many bytes
# (about the L3 of the 2-core machines measured; docs/design.md, "Row tiles"): a prefill step of 8,192 tokens
# otherwise writes and reads its intermediates from memory (the small model's MLP, 8,192 rows: float32 158 ->
# 177-184 GFLOP/s in tiles of 2,048 rows, bfloat16 334 -> 375-380 in tiles of 4,096).
ROW_TILE_BYTES = 24 << 20


def row_tile(tokens: int, gate_up_width: int, element_size: int) -> int:
    """The rows of each tile for a call of `tokens` rows (`tokens`: one call), split evenly so that no tile is
    a handful of rows."""
    tiles = -(-tokens * gate_up_width * element_size // ROW_TILE_BYTES)
    return tokens if tiles <= 1 else -(-tokens // tiles)


MAX_PLANS = 8  # per layer: the row counts a run's steps keep coming back to (decode rows, chunk sizes)
# A plan's product tensor that is read from its pack at each call (`LayerPlan.packs`).
_FROM_PACK = torch.empty(0)


def make_plan(parts: LayerParts, dtype: torch.dtype, tokens: int) -> LayerPlan | None:
    """What the modules' forwards would compute for `tokens` rows of `dtype`, as the native call's arguments
    (with what was read to decide it), or None where a part would leave the native paths."""
    attention, mlp = parts.attention, parts.mlp
    interface = nn_module_interface(attention)
    if not getattr(interface, NATIVE_STEPS_MARK, False):
        return None
    attention_projections = projections_of(attention, PROJECTIONS, dtype, tokens)
    mlp_projections = projections_of(mlp, MLP_PROJECTIONS, dtype, tokens)
    input_weight = parts.input_norm._parameters.get("weight")
    post_weight = parts.post_norm._parameters.get("weight")
    if (
        attention_projections is None
        or mlp_projections is None
        or input_weight is None
        or post_weight is None
        or mlp_projections[0][0].out_features != mlp_projections[1][0].out_features
        or not plain_cpu(input_weight, dtype)
        or not plain_cpu(post_weight, dtype)
        or not input_weight.is_contiguous()
        or not post_weight.is_contiguous()
    ):
        return None
    specs = ProductSpecs()
    qkv_count, qkv_split = add_products(specs, attention_projections[:3], dtype, tokens)
    add_products(specs, attention_projections[3:], dtype, tokens)
    gate_up_count, gate_up_split = add_products(specs, mlp_projections[:2], dtype, tokens)
    add_products(specs, mlp_projections[2:], dtype, tokens)
    slots: list[tuple[dict[str, Any], str, object]] = [
        (parts.input_norm._parameters, "weight", input_weight),
        (parts.post_norm._parameters, "weight", post_weight),
    ]
    tensors: list[torch.Tensor] = [input_weight, post_weight]
    qtypes: list[tuple[QuantizedLinear, int]] = []
    intx: list[tuple[nn.Linear, IntxBlocks]] = []
    groups: list[FusedGroup] = []
    for owner, names, projections in (
        (attention, PROJECTIONS, attention_projections),
        (mlp, MLP_PROJECTIONS, mlp_projections),
    ):
        for name, (module, product) in zip(names, projections, strict=True):
            slots.append((owner._modules, name, module))
            slots.append((module.__dict__, "forward", module.__dict__.get("forward")))
            for held in (module._parameters, module._buffers):  # weight, bias; a QuantizedLinear's blocks
                for key, tensor in held.items():
                    slots.append((held, key, tensor))
                    if tensor is not None:
                        tensors.append(tensor)
            if isinstance(module, QuantizedLinear):
                qtypes.append((module, module.kernel_qtype))
            elif isinstance(product, IntxBlocks):
                intx.append((module, product))
            elif isinstance(product, PackedProduct) and product.group is not None:
                groups.append(product.group)
    # a torchao weight's parts are checked by `intx`; an inference tensor cannot be written in place (no
    # version), only replaced (its slot)
    plain = [t for t in tensors if plain_tensor(t) and not t.is_inference()]
    watched: tuple[nn.Module, ...] = (attention, mlp, parts.input_norm, parts.post_norm, parts.act_fn)
    watched += tuple(projection for projection, _ in attention_projections + mlp_projections)
    if any(hooked(part) for part in watched):
        return None
    for part in watched:
        slots.append((part.__dict__, "_hf_hook", part.__dict__.get("_hf_hook")))
    packs = tuple(
        None if source is None else (source[0], weakref.ref(source[1]), kind)
        for source, kind in zip(specs.packs, specs.kinds, strict=True)
    )
    # read from the pack at each call: the plan keeps no packed weight alive (a fused pack's concatenated bias,
    # a few KB, stays held until the plan is made again)
    for index, source in enumerate(specs.packs):
        if source is not None:
            specs.tensors[index] = _FROM_PACK
            specs.packs[index] = None
    return LayerPlan(
        slots=tuple(slots),
        tensors=tuple((t, t._version, t.data_ptr()) for t in plain),
        hooks=tuple(
            registry
            for module in watched
            for registry in (
                module._forward_hooks,
                module._forward_pre_hooks,
                module._backward_hooks,
                module._backward_pre_hooks,
            )
        ),
        groups=tuple({id(group): group for group in groups}.values()),
        qtypes=tuple(qtypes),
        intx=tuple(intx),
        packs=packs,
        specs=specs,
        input_weight=input_weight,
        post_weight=post_weight,
        qkv_count=qkv_count,
        qkv_split=qkv_split,
        gate_up_count=gate_up_count,
        gate_up_split=gate_up_split,
        # oneDNN's products give each row the same bits in a tile as in the whole (measured; `F.linear`'s
        # MKL products are not known to): only an all-oneDNN layer is tiled
        tile_rows=(
            row_tile(tokens, 2 * mlp_projections[0][0].out_features, dtype.itemsize)  # gate and up: one width
            if set(specs.kinds) == {1}
            else tokens
        ),
    )


def plan_for(
    parts: LayerParts, dtype: torch.dtype, tokens: int
) -> tuple[LayerPlan, list[torch.Tensor]] | None:
    """The layer's plan for this call (reused where nothing it read changed) and its products' tensors."""
    plan = parts.plans.get((tokens, dtype))
    tensors = None if plan is None else plan.current_tensors(dtype, tokens)
    if plan is None or tensors is None:
        if plan is not None:
            parts.plans.clear()  # what one plan read changed: the others may hold stale weights too
        plan = make_plan(parts, dtype, tokens)
        if plan is None:
            return None
        tensors = plan.current_tensors(dtype, tokens)
        if tensors is None:  # a pack released while the plan was made
            return None
        if len(parts.plans) >= MAX_PLANS:
            parts.plans.pop(next(iter(parts.plans)))
        parts.plans[(tokens, dtype)] = plan
    return plan, tensors


def nn_module_interface(attention: nn.Module) -> object:
    """The attention function the module's forward would look up for its config's implementation."""
    config = getattr(attention, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    return ALL_ATTENTION_FUNCTIONS.get(implementation) if isinstance(implementation, str) else None
