"""`StateCache`: the state layers' tensors, one row per state slot.

A state layer (transformers' `linear_attention` / `conv` / `hybrid` layer types: gated delta rule,
Mamba, short convolutions) keeps, per request, a convolution window and a recurrent state of fixed size,
through transformers' linear-attention cache API (`get_conv_state`, `update_conv_state`, ...). Here each
such state of each layer is one tensor `[num_slots, *shape]` in the dtype transformers' own cache would
hold it in; a request's state is the row of its slot (kv/state_slots.py). The shapes are learned before
allocation from the layers themselves (`StateSpec`, engine/state_probe.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CONV = "conv"
RECURRENT = "recurrent"


@dataclass(frozen=True)
class StateSpec:
    """One state tensor of one layer: `kind` (CONV / RECURRENT), its index among the layer's states,
    its per-request `shape` and dtype."""

    layer_idx: int
    kind: str
    state_idx: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def key(self) -> tuple[int, str, int]:
        return self.layer_idx, self.kind, self.state_idx

    def nbytes(self) -> int:
        """Bytes of one request's copy."""
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * torch.tensor([], dtype=self.dtype).element_size()


def state_bytes_per_slot(specs: tuple[StateSpec, ...]) -> int:
    """One request's state in every state layer."""
    return sum(spec.nbytes() for spec in specs)


class StateCache:
    """The state tensors of `num_slots` requests (zero-filled; a fresh request never reads its row)."""

    def __init__(self, specs: tuple[StateSpec, ...], num_slots: int, device: torch.device) -> None:
        self.specs = specs
        self.num_slots = num_slots
        self.tensors: dict[tuple[int, str, int], torch.Tensor] = {
            spec.key: torch.zeros(num_slots, *spec.shape, dtype=spec.dtype, device=device) for spec in specs
        }
        self.layers = sorted({spec.layer_idx for spec in specs})

    def tensor(self, layer_idx: int, kind: str, state_idx: int) -> torch.Tensor | None:
        return self.tensors.get((layer_idx, kind, state_idx))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())
