"""Packed products for every dense CPU `nn.Linear` of a model (LM head included), for the run only.

`packed_linears(model, enabled)` is entered beside `attention.selection.paged_attention` wherever the
engine runs (`generate_batch`, the manager's thread and its `warmup()`). Inside, each eligible Linear
instance gets an instance attribute `forward` that calls `packed_linear.packed_linear`; on exit (and on
`plugin.uninstall`, `restore_all`) the attribute is deleted, so the class's own forward
shows again. Why an instance attribute: no module is replaced (the user's module tree, its types,
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
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from .packed_linear import (
    NEVER,
    PACKED_DTYPES,
    PACKS,
    PackRule,
    packed_linear,
    packed_linear_eager,
    rule_from_env,
)

_handles: weakref.WeakKeyDictionary[nn.Linear, int] = weakref.WeakKeyDictionary()
# id(module) -> (module, the forward set on it): every swap in force, for `restore_all`.
_active: dict[int, tuple[nn.Module, Callable[[torch.Tensor], torch.Tensor]]] = {}
_lock = threading.Lock()


def is_packable(module: nn.Module) -> bool:
    """A plain dense `nn.Linear` (not a subclass: their forward may differ) whose weight is an ordinary
    CPU tensor of a packed dtype, with no forward of its own already set on the instance (accelerate's
    hooks set one: they must keep running)."""
    if type(module) is not nn.Linear or "forward" in module.__dict__ or hasattr(module, "_hf_hook"):
        return False
    weight = module.weight
    return (
        type(weight.data) is torch.Tensor  # not a DTensor, a quantized or a meta-offloaded weight
        and weight.device.type == "cpu"
        and weight.dtype in PACKED_DTYPES
        and not weight.is_inference()
    )


def _handle_of(module: nn.Linear) -> int:
    handle = _handles.get(module)
    if handle is None:
        handle = PACKS.new_handle()
        _handles[module] = handle
        weakref.finalize(module, PACKS.drop, handle)
    return handle


def _packed_forward(
    module: nn.Linear, handle: int, min_rows: int
) -> Callable[[torch.Tensor], torch.Tensor]:
    # Below `min_rows` rows MKL's plain product is the faster one (`PackRule`).
    min_numel = min_rows * module.in_features

    def forward(input: torch.Tensor) -> torch.Tensor:
        weight, bias = module.weight, module.bias
        if torch.is_grad_enabled() or input.dtype != weight.dtype or input.device != weight.device:
            return F.linear(input, weight, bias)
        if torch.compiler.is_compiling():
            return packed_linear(input, weight, bias, handle)
        if input.numel() < min_numel:
            return F.linear(input, weight, bias)
        return packed_linear_eager(input, weight, bias, handle)

    return forward


def packed_plan(model: nn.Module, rule: PackRule) -> list[tuple[nn.Linear, int]]:
    """The Linears of `model` the rule packs, each with the row count from which it runs packed."""
    plan = []
    for module in model.modules():
        if isinstance(module, nn.Linear) and is_packable(module):
            min_rows = rule.min_rows(module.weight)
            if min_rows < NEVER:
                plan.append((module, min_rows))
    return plan


def pack_bytes(model: nn.Module, rule: PackRule) -> tuple[int, int]:
    """(bytes of the packed copies the rule makes for `model`, of those not built yet): a packed copy is
    the weight's size (oneDNN's blocked layout pads by a few elements at most)."""
    total = missing = 0
    for module, _min_rows in packed_plan(model, rule):
        size = module.weight.numel() * module.weight.element_size()
        total += size
        handle = _handles.get(module)
        if handle is None or not PACKS.has_pack(handle):
            missing += size
    return total, missing


def model_pack_bytes(model: nn.Module) -> int:
    """Bytes of the packed copies held now for `model`'s Linears (`stats()`)."""
    handles = [_handles.get(m) for m in model.modules() if isinstance(m, nn.Linear)]
    return PACKS.packed_bytes([h for h in handles if h is not None])


def _restore(swaps: Sequence[tuple[nn.Module, Callable[[torch.Tensor], torch.Tensor]]]) -> None:
    with _lock:
        for module, forward in swaps:
            if module.__dict__.get("forward") is forward:
                del module.__dict__["forward"]
            _active.pop(id(module), None)


@contextmanager
def packed_linears(model: nn.Module, enabled: bool) -> Iterator[int]:
    """Inside (with `enabled`): the packable Linears of `model` that the rule picks (`PackRule`, from
    `TRANSFORMERS_CB_PACKED_LINEAR`) run packed products. Yields how many."""
    rule = rule_from_env() if enabled else None
    if rule is None:
        yield 0
        return
    swaps = []
    with _lock:
        for module, min_rows in packed_plan(model, rule):
            forward = _packed_forward(module, _handle_of(module), min_rows)
            module.__dict__["forward"] = forward
            swaps.append((module, forward))
            _active[id(module)] = (module, forward)
    try:
        yield len(swaps)
    finally:
        _restore(swaps)


def restore_all() -> None:
    """Give every Linear swapped by a `packed_linears` block still in force its class's forward back
    (`uninstall()`); a run still going finishes on plain products."""
    with _lock:
        swaps = list(_active.values())
    _restore(swaps)


def release_packs(model: nn.Module) -> None:
    """Free the packed copies of `model`'s Linears (rebuilt at their next packed product). Also the way
    to make packs see weights written through `.data`, which bumps no version counter."""
    for module in model.modules():
        handle = _handles.get(module) if isinstance(module, nn.Linear) else None
        if handle is not None:
            PACKS.invalidate(handle)
