"""Tensors given back and rebuilt in place: the manager's `release_cache()` / `resume_cache()` (docs/manager.md).

The KV tiers are lists of tensors that several owners hold by reference (the device cache's group tensors:
the copier between the tiers, memory/swap.py; the host tier's). Each tensor is replaced *in the same list*
by an empty one of its dtype and device, so that its memory goes back to the allocator (on CPU a large
allocation goes back to the OS at once: the process's RSS drops by it) while every holder keeps its list;
`restore_in_place` puts tensors of the same shapes back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .zeroed import zeroed


@dataclass(frozen=True)
class TensorSpec:
    """What a released tensor was: enough to allocate it again."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    pinned: bool

    @staticmethod
    def of(tensor: torch.Tensor) -> TensorSpec:
        pinned = tensor.device.type == "cpu" and tensor.is_pinned()
        return TensorSpec(tuple(tensor.shape), tensor.dtype, tensor.device, pinned)

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * torch.empty((), dtype=self.dtype).element_size()


def release_in_place(tensors: list[torch.Tensor]) -> list[TensorSpec]:
    """Replace every tensor of `tensors` by an empty one (same dtype and device); returns what they were."""
    specs = [TensorSpec.of(t) for t in tensors]
    tensors[:] = [torch.empty(0, dtype=s.dtype, device=s.device) for s in specs]
    return specs


def restore_in_place(tensors: list[torch.Tensor], specs: list[TensorSpec], zero: bool) -> None:
    """Allocate `specs` again into `tensors` (zero-filled with `zero`: the device cache's padded gathers
    must never read NaN; the host tier is only read where a swap-out wrote it)."""
    tensors[:] = [_allocate(s, zero) for s in specs]


def _allocate(spec: TensorSpec, zero: bool) -> torch.Tensor:
    if zero and not spec.pinned:
        return zeroed(spec.shape, spec.dtype, spec.device)
    make = torch.zeros if zero else torch.empty
    return make(spec.shape, dtype=spec.dtype, device=spec.device, pin_memory=spec.pinned)
