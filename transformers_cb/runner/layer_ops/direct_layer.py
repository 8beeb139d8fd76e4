"""A Llama-form decoder layer's step as one native call: the same ops as its modules' forwards, without the
calls between them.

A decode step's layer on a small model is mostly calls: its ~13 module calls, the attention interface's
keyword handling, the fused product's hand-over between siblings, the checks each replaced forward repeats
and ~40 small torch calls at 2-5 us each here (a 30-layer width-192 model: 15-20 ms a step). `direct_step`
decides in Python what each part of the layer's forwards would do for this call (each projection's product
as its forward would pick it: `ProductSpecs`) and runs the whole layer in `decoder_layer`
(attention/native/native_decoder_source.py), which makes the same calls in the same order from C++. So
outputs are the same bits either way (tests/runner/test_direct_layer.py): only calls are saved. Where any
part would take another path it returns None and the modules' own forwards run; a native call that raises
falls back once, with a warning.

It applies to a layer whose forward, attention, MLP and both norms are replaced by the native layer ops
(runner/layer_ops/native_layers.py: their forms recognised by code, Llama's attention among them), whose
modeling file's rotary is the native one, whose projections are plain `nn.Linear`s (packed or not) of plain
CPU tensors, or a GGUF model's `QuantizedLinear`s on the rows their forward gives `quant_matmul`, with no
hooks anywhere on the way (nor global ones), on an all-native step (attention/paged.py)
of a paged backend whose layer has no window, ALiBi, latent, repeated K/V or int8 cache, outside autograd
and compile. `TRANSFORMERS_CB_DIRECT_LAYERS=0` turns it off.
"""

from __future__ import annotations

import logging
import sys
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, cast

import torch
from torch import nn
from torch.nn.modules import module as nn_module
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ...attention.families.temperature import tunes_temperature
from ...attention.metadata import AttentionMetadata
from ...attention.paged import METADATA_KWARG, NATIVE_STEPS_MARK, current_step_metadata
from ...patches import in_force
from ..products.fused_products import FusedGroup
from ..products.packed_linear import PACKS, Pack
from ..products.packed_model import PackedProduct, packed_product_of
from ..products.quantized_linear import QuantizedLinear, takes_direct
from ..products.small_rows import row_pack_for
from ..products.torchao_linear import IntxBlocks, intx_blocks_for
from .layer_forms import (
    child,
    has_hooks,
    norm_eps,
    norm_form,
    plain_tensor,
    references,
    same_function,
)

logger = logging.getLogger(__name__)

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
# Set by the first native call that raised: the modules' forwards run from then on in this process.
_failed: list[str] = []


def _fail(error: RuntimeError) -> None:
    if not _failed:
        _failed.append(f"{type(error).__name__}: {error}")
        logger.warning(
            "transformers_cb: the native decoder-layer step failed (%s); layers run their modules' forwards "
            "from now on",
            _failed[0],
        )


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


def _hooked(module: nn.Module) -> bool:
    """Hooks that `nn.Module.__call__` would run (the direct step skips it)."""
    return has_hooks(module) or bool(module._backward_hooks or module._backward_pre_hooks)


def _plain(tensor: torch.Tensor, dtype: torch.dtype) -> bool:
    return plain_tensor(tensor) and tensor.is_cpu and tensor.dtype == dtype


def _global_hooks() -> bool:
    return bool(
        nn_module._global_forward_hooks
        or nn_module._global_forward_pre_hooks
        or nn_module._global_backward_hooks
        or nn_module._global_backward_pre_hooks
    )


# A projection as this call will run it: (module, its packed product, or the GGUF blocks a torchao Intx
# Linear's run forward reads, or None for a plain or quantized Linear).
Projection = tuple[nn.Linear | QuantizedLinear, PackedProduct | IntxBlocks | None]


def _quantized(module: QuantizedLinear, dtype: torch.dtype, rows: int) -> bool:
    """Whether `module`'s forward runs the native product over its blocks on `rows` rows of `dtype`
    (`quantized_product`'s rule; beyond it the dequantized tiles' path, which the modules' forwards take)."""
    blocks, bias = module._buffers["blocks"], module._parameters.get("bias")
    return (
        "forward" not in module.__dict__
        and not _hooked(module)
        and takes_direct(module.kernel_qtype, dtype, rows)
        and blocks is not None
        and plain_tensor(blocks)
        and blocks.is_cpu
        and blocks.is_contiguous()
        and (bias is None or (plain_tensor(bias) and bias.is_cpu))
    )


def _projections(
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
        if type(module) is not nn.Linear or _hooked(module):
            return None
        blocks = intx_blocks_for(module, dtype, rows)
        if blocks is not None:
            found.append((module, blocks))
            continue
        weight, bias = module._parameters["weight"], module._parameters["bias"]
        # plain CPU tensors only: a DTensor or another subclass keeps its own dispatch (the modules' path)
        if weight is None or not _plain(weight, dtype) or (bias is not None and not _plain(bias, dtype)):
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
        rows_pack = row_pack_for(pack, dtype, rows)
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


def _add_products(
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


def _step_metadata(kwargs: dict[str, Any]) -> AttentionMetadata | None:
    """The step's metadata when it is the layer's only keyword (anything else goes to the attention
    function, which the direct step does not call)."""
    if len(kwargs) != 1 or METADATA_KWARG not in kwargs:
        return None
    metadata = kwargs[METADATA_KWARG]
    if metadata is None:
        metadata = current_step_metadata()
    return metadata if isinstance(metadata, AttentionMetadata) else None


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


MAX_PLANS = 8  # per layer: the row counts a run's steps keep coming back to (decode rows, chunk sizes)
# A plan's product tensor that is read from its pack at each call (`LayerPlan.packs`).
_FROM_PACK = torch.empty(0)


def _make_plan(parts: LayerParts, dtype: torch.dtype, tokens: int) -> LayerPlan | None:
    """What the modules' forwards would compute for `tokens` rows of `dtype`, as the native call's arguments
    (with what was read to decide it), or None where a part would leave the native paths."""
    attention, mlp = parts.attention, parts.mlp
    interface = nn_module_interface(attention)
    if not getattr(interface, NATIVE_STEPS_MARK, False):
        return None
    attention_projections = _projections(attention, PROJECTIONS, dtype, tokens)
    mlp_projections = _projections(mlp, MLP_PROJECTIONS, dtype, tokens)
    input_weight = parts.input_norm._parameters.get("weight")
    post_weight = parts.post_norm._parameters.get("weight")
    if (
        attention_projections is None
        or mlp_projections is None
        or input_weight is None
        or post_weight is None
        or mlp_projections[0][0].out_features != mlp_projections[1][0].out_features
        or not _plain(input_weight, dtype)
        or not _plain(post_weight, dtype)
        or not input_weight.is_contiguous()
        or not post_weight.is_contiguous()
    ):
        return None
    specs = ProductSpecs()
    qkv_count, qkv_split = _add_products(specs, attention_projections[:3], dtype, tokens)
    _add_products(specs, attention_projections[3:], dtype, tokens)
    gate_up_count, gate_up_split = _add_products(specs, mlp_projections[:2], dtype, tokens)
    _add_products(specs, mlp_projections[2:], dtype, tokens)
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
            held = module._buffers if isinstance(module, QuantizedLinear) else module._parameters
            for key in ("blocks", "weight", "bias"):
                if key in held:
                    slots.append((held, key, held[key]))
                    if held[key] is not None:
                        tensors.append(cast(torch.Tensor, held[key]))
            if isinstance(module, QuantizedLinear):
                bias = module._parameters.get("bias")
                slots.append((module._parameters, "bias", bias))
                if bias is not None:
                    tensors.append(bias)
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
    if any(_hooked(part) for part in watched):
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
    )


def _plan(parts: LayerParts, dtype: torch.dtype, tokens: int) -> tuple[LayerPlan, list[torch.Tensor]] | None:
    """The layer's plan for this call (reused where nothing it read changed) and its products' tensors."""
    plan = parts.plans.get((tokens, dtype))
    tensors = None if plan is None else plan.current_tensors(dtype, tokens)
    if plan is None or tensors is None:
        if plan is not None:
            parts.plans.clear()  # what one plan read changed: the others may hold stale weights too
        plan = _make_plan(parts, dtype, tokens)
        if plan is None:
            return None
        tensors = plan.current_tensors(dtype, tokens)
        if tensors is None:  # a pack released while the plan was made
            return None
        if len(parts.plans) >= MAX_PLANS:
            parts.plans.pop(next(iter(parts.plans)))
        parts.plans[(tokens, dtype)] = plan
    return plan, tensors


def direct_step(
    parts: LayerParts,
    ops: ModuleType,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None,
    kwargs: dict[str, Any],
) -> torch.Tensor | None:
    """The layer's output on `hidden_states` `[1, T, hidden]` (its residual stream), or None where any part
    of this call would leave the native paths (the caller then runs the modules' forwards)."""
    attention = parts.attention
    metadata = _step_metadata(kwargs)
    if (
        _failed
        or metadata is None
        or not metadata.all_native
        or position_embeddings is None
        or hidden_states.dim() != 3
        or hidden_states.shape[0] != 1
        or not hidden_states.is_contiguous()
        or attention.training
        or tunes_temperature(attention)
        or _global_hooks()  # the layer's own modules' hooks: its plan watches them
    ):
        return None
    layer_idx = parts.layer_idx
    cache = metadata.cache
    group_metadata = metadata.group_of(layer_idx)
    spec = metadata.kv_group_of(layer_idx)
    if (
        group_metadata.sliding_window is not None
        or group_metadata.latent is not None
        or spec.kv_repeat != 1
        or cache.key_dim(cache.layer_group[layer_idx]) is not None
        or metadata.token_row is None
        or metadata.token_pos is None
    ):
        return None
    dtype = hidden_states.dtype
    cos, sin = position_embeddings
    tokens, head_dim = hidden_states.shape[1], parts.head_dim
    if (
        not _plain(cos, dtype)
        or not _plain(sin, dtype)
        or cos.dim() != 3
        or cos.shape != sin.shape
        or cos.shape[0] != 1
        or cos.shape[1:] != (tokens, head_dim)
        or cos.stride(-1) != 1
        or sin.stride(-1) != 1
    ):
        return None
    storage, layer = cache.storage_of(layer_idx)
    if cache.scales_of(layer_idx) is not None or storage.dtype != dtype:
        return None  # an int8 cache (or pages of another dtype): the modules' path writes and reads them
    planned = _plan(parts, dtype, tokens)
    if planned is None:
        return None
    plan, tensors = planned
    specs = plan.specs
    # LlamaDecoderLayer's forward with native_layers' ops, LlamaAttention's with the native rotary and the
    # all-native step's attention, LlamaMLP's with SiLU·mul: one call
    try:
        out: torch.Tensor = ops.decoder_layer(
            hidden_states,
            plan.input_weight,
            parts.input_eps,
            parts.input_gemma,
            plan.post_weight,
            parts.post_eps,
            parts.post_gemma,
            specs.kinds,
            tensors,
            specs.biases,
            specs.outs,
            specs.qtypes,
            plan.qkv_count,
            plan.qkv_split,
            plan.gate_up_count,
            plan.gate_up_split,
            cos,
            sin,
            parts.head_dim,
            storage,
            layer,
            group_metadata.slot_mapping,
            metadata.token_row,
            metadata.token_pos,
            group_metadata.block_table,
            cache.page_size,
            parts.scaling,
            group_metadata.kernel_window,
        )
    except RuntimeError as error:
        # An optional part that fails (a torch whose oneDNN op has another signature, say) falls back, once:
        # nothing is lost (a K/V row written before the failure is written again with the same values).
        _fail(error)
        return None
    return out


def nn_module_interface(attention: nn.Module) -> object:
    """The attention function the module's forward would look up for its config's implementation."""
    config = getattr(attention, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    return ALL_ATTENTION_FUNCTIONS.get(implementation) if isinstance(implementation, str) else None
