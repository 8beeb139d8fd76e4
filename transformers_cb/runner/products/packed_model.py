"""Packed products for every dense CPU `nn.Linear` of a model (LM head included), for the run only.

`packed_linears(model, enabled)` is entered beside `attention.selection.paged_backend` by
`Engine.session()`, the one run session of every caller that steps an engine (`generate_batch`, the
manager's thread and its `warmup()`). Inside, each eligible Linear
instance gets an instance attribute `forward` that calls `packed_linear.packed_linear` (a counted patch,
patches.py: overlapping runs share it); when the last run using it ends (and on `plugin.uninstall`) the
attribute is deleted, so the class's own forward shows again. Why an instance attribute: no module is
replaced (the user's module tree, its types,
state dict and hooks stay the same objects), nothing outlives the run, and `torch.compile` traces it like
any forward. The packed forward still takes the plain path when autograd records (`torch.is_grad_enabled`:
training inside the block keeps its gradients) or when the input's dtype / device differs from the weight's.

The packs themselves outlive the run (they are made once per model, `packed_linear.PACKS`): they are
keyed by a handle per Linear instance, freed when that module is collected, and dropped on demand by
`release_packs` (also run by `destroy_cached_continuous_batching_manager`). Each product checks its
weight's version counter and data pointer, so a pack is never used stale.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from ...patches import in_force, patched
from .fused_products import FusedGroup, find_groups
from .packed_linear import (
    NEVER,
    PACKED_DTYPES,
    PACKS,
    PackRule,
    fusion_from_env,
    pack_dtype,
    packed_linear,
    packed_linear_eager,
    rule_from_env,
)
from .small_rows import has_rows_pack

_handles: weakref.WeakKeyDictionary[nn.Linear, int] = weakref.WeakKeyDictionary()
# A fused group's pack handle, kept by its first member (so consecutive runs do not repack).
_group_handles: weakref.WeakKeyDictionary[nn.Linear, int] = weakref.WeakKeyDictionary()
PATCH_KIND = "packed_linears"  # its counted patches (patches.py)
_lock = threading.Lock()


def is_packable(module: nn.Module) -> bool:
    """A plain dense `nn.Linear` (not a subclass: their forward may differ) whose weight is an ordinary
    CPU tensor of a packed dtype, with no forward of its own already set on the instance (accelerate's
    hooks set one: they must keep running)."""
    if type(module) is not nn.Linear or hasattr(module, "_hf_hook"):
        return False
    if "forward" in module.__dict__ and not in_force(PATCH_KIND, module, "forward"):
        return False
    weight = module.weight
    return (
        type(weight.data) is torch.Tensor  # not a DTensor, a quantized or a meta-offloaded weight
        and weight.device.type == "cpu"
        and weight.dtype in PACKED_DTYPES
        and not weight.is_inference()
    )


def _handle_in(handles: weakref.WeakKeyDictionary[nn.Linear, int], module: nn.Linear) -> int:
    """`module`'s handle in `handles`, registered (and dropped with the module) on first use."""
    handle = handles.get(module)
    if handle is None:
        handle = PACKS.new_handle()
        handles[module] = handle
        weakref.finalize(module, PACKS.drop, handle)
    return handle


def _handle_of(module: nn.Linear) -> int:
    return _handle_in(_handles, module)


def _group_handle_of(first: nn.Linear) -> int:
    return _handle_in(_group_handles, first)


@dataclass(frozen=True)
class PackedProduct:
    """What a packed Linear's instance forward computes with, for a caller that runs the product itself
    (runner/layer_ops/direct_layer.py): its pack handle, the row count from which it runs packed, and its
    fused group (None: a single product) with its index there."""

    handle: int
    min_rows: int
    group: FusedGroup | None = None
    index: int = 0


def packed_product_of(module: nn.Module) -> PackedProduct | None:
    """The `PackedProduct` of `module`'s instance forward, if that forward is a packed one."""
    forward = module.__dict__.get("forward")
    product = getattr(forward, "packed_product", None)
    return product if isinstance(product, PackedProduct) else None


def _packed_forward(
    module: nn.Linear,
    handle: int,
    min_rows: int,
    eager: Callable[[torch.Tensor], torch.Tensor] | None = None,
    group: FusedGroup | None = None,
    index: int = 0,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The instance forward of a packed Linear: `eager(input)` (default: its own packed product) in an eager
    forward from `min_rows` rows; below them MKL's plain product, the faster one there (`PackRule`); the
    custom op in a compiled forward; `F.linear` when autograd records or the input's dtype / device
    differs."""
    min_numel = min_rows * module.in_features

    def forward(input: torch.Tensor) -> torch.Tensor:
        weight, bias = module.weight, module.bias
        if torch.is_grad_enabled() or input.dtype != weight.dtype or input.device != weight.device:
            return F.linear(input, weight, bias)
        if torch.compiler.is_compiling():
            return packed_linear(input, weight, bias, handle)
        if input.numel() < min_numel:
            return F.linear(input, weight, bias)
        if eager is not None:
            return eager(input)
        return packed_linear_eager(input, weight, bias, handle)

    forward.__dict__["packed_product"] = PackedProduct(handle, min_rows, group, index)
    return forward


def _fused_forward(
    group: FusedGroup, index: int, handle: int, min_rows: int
) -> Callable[[torch.Tensor], torch.Tensor]:
    """A fused group's member: its columns of the group's product (`FusedGroup.take`) in eager forwards,
    its own packed product once the group is unfused."""
    module = group.members[index]

    def eager(input: torch.Tensor) -> torch.Tensor:
        output = group.take(index, input)
        if output is None:
            return packed_linear_eager(input, module.weight, module.bias, handle)
        return output

    return _packed_forward(module, handle, min_rows, eager, group, index)


@dataclass
class PackingSettings:
    """What a run packs: single Linears with the row count from which each runs packed, and fused groups
    with theirs (`PackRule`, on the group's weights together)."""

    singles: list[tuple[nn.Linear, int]]
    groups: list[tuple[FusedGroup, int]]

    def pack_sizes(self) -> list[tuple[int, int | None]]:
        """(bytes, handle) of every pack these settings use in eager steps: a bf16 weight the small-row product
        serves counts twice (its row pack, runner/products/small_rows.py)."""
        sizes = [(_pack_size(m.weight, m.out_features), _handles.get(m)) for m, _ in self.singles]
        for group, _ in self.groups:
            out_features = sum(m.out_features for m in group.members)
            size = sum(_pack_size(m.weight, out_features) for m in group.members)
            sizes.append((size, group.handle))
        return sizes


def _pack_size(weight: torch.Tensor, out_features: int) -> int:
    """Bytes of `weight`'s packs, in a product of `out_features` outputs."""
    dtype = pack_dtype(weight.dtype)  # float32 for a bf16 weight where oneDNN refuses bf16
    copies = 2 if has_rows_pack(out_features, weight.shape[-1], dtype) else 1
    return weight.numel() * dtype.itemsize * copies


def packing_settings(model: nn.Module, rule: PackRule, fuse: bool | None = None) -> PackingSettings:
    """The Linears of `model` the rule packs (fused by sibling group unless `fuse` is False; None: as
    `TRANSFORMERS_CB_FUSED_PRODUCTS` says)."""
    if fuse is None:
        fuse = fusion_from_env()
    groups: list[tuple[FusedGroup, int]] = []
    grouped: set[int] = set()
    if fuse:
        for group in find_groups(model, is_packable, _group_handle_of):
            min_rows = rule.min_rows_of(group.members[0].weight.dtype, group.numel)
            if min_rows < NEVER:
                groups.append((group, min_rows))
                grouped.update(id(m) for m in group.members)
    singles = []
    for module in model.modules():
        if isinstance(module, nn.Linear) and id(module) not in grouped and is_packable(module):
            min_rows = rule.min_rows(module.weight)
            if min_rows < NEVER:
                singles.append((module, min_rows))
    return PackingSettings(singles, groups)


def pack_bytes(model: nn.Module, rule: PackRule) -> tuple[int, int]:
    """(bytes of the packed copies the rule makes for `model`, of those not built yet): a packed copy is
    the weight's size (oneDNN's blocked layout pads by a few elements at most), twice where the small-row
    product keeps its own copy (while `small_rows.allow_row_packs` allows row packs)."""
    total = missing = 0
    for size, handle in packing_settings(model, rule).pack_sizes():
        total += size
        if handle is None or not PACKS.has_pack(handle):
            missing += size
    return total, missing


def model_pack_bytes(model: nn.Module) -> int:
    """Bytes of the packed copies held now for `model`'s Linears (`stats()`), fused ones included."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    handles = [_handles.get(m) for m in linears] + [_group_handles.get(m) for m in linears]
    return PACKS.packed_bytes([h for h in handles if h is not None])


@contextmanager
def packed_linears(model: nn.Module, enabled: bool) -> Iterator[int]:
    """Inside (with `enabled`): the packable Linears of `model` that the rule picks (`PackRule`, from
    `TRANSFORMERS_CB_PACKED_LINEAR`) run packed products. Yields how many."""
    rule = rule_from_env() if enabled else None
    if rule is None:
        yield 0
        return
    with _lock:
        settings = packing_settings(model, rule)
        _drop_rewritten_packs(settings)
        forwards = [
            (m, "forward", partial(_packed_forward, m, _handle_of(m), rows)) for m, rows in settings.singles
        ]
        for group, rows in settings.groups:
            forwards += [
                (m, "forward", partial(_fused_forward, group, i, _handle_of(m), rows))
                for i, m in enumerate(group.members)
            ]
    try:
        with patched(PATCH_KIND, forwards) as count:
            yield count
    finally:
        for group, _rows in settings.groups:
            group.pending.clear()


def _drop_rewritten_packs(settings: PackingSettings) -> None:
    """Free the packs whose weights were replaced or rewritten since they were built without a key showing
    it (`PackRegistry.check_sources`): packs outlive runs, and between two runs a caller such as a trainer
    may write the weights through `.data` (no version bump) with nobody to tell the engine."""
    for module, _ in settings.singles:
        _check_module(module)
    for group, _ in settings.groups:
        weights = tuple(m.weight for m in group.members)
        PACKS.check_sources(group.handle, weights + tuple(m.bias for m in group.members))
        for module in group.members:
            _check_module(module)


def _check_module(module: nn.Linear) -> None:
    handle = _handles.get(module)
    if handle is not None:
        PACKS.check_sources(handle, (module.weight,))


def release_packs(model: nn.Module) -> None:
    """Free the packed copies of `model`'s Linears, fused ones included (rebuilt at their next packed
    product). Also the way to make packs see weights written through `.data`, which bumps no version
    counter."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            for handle in (_handles.get(module), _group_handles.get(module)):
                if handle is not None:
                    PACKS.invalidate(handle)
