"""`StateCache`: the state layers' tensors, one row per state slot.

A state layer (transformers' `linear_attention` / `conv` / `hybrid` layer types: gated delta rule,
Mamba, short convolutions) keeps, per request, a convolution window and a recurrent state of fixed size,
through transformers' linear-attention cache API (`get_conv_state`, `update_conv_state`, ...) or in a
cache of the model's own (MiniMax, RecurrentGemma, RWKV, xLSTM: runner/states/own_state.py). Here each
such state of each layer is one tensor `[num_slots, *shape]` in the dtype transformers' own cache would
hold it in; a request's state is the row of its slot (kv/state_slots.py). The shapes are learned before
allocation from the layers themselves (`StateSpec`, model_check/state_probe.py).
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
    """The state tensors of `num_slots` requests (zero-filled; a fresh request never reads its row).

    `empty`: not zero-filled (the host tier's copy, only read after a swap-out wrote it; an untouched
    allocation costs no RAM on a CPU host until used)."""

    def __init__(
        self, specs: tuple[StateSpec, ...], num_slots: int, device: torch.device, empty: bool = False
    ) -> None:
        self.specs = specs
        self.num_slots = num_slots
        make = torch.empty if empty else torch.zeros
        self.tensors: dict[tuple[int, str, int], torch.Tensor] = {
            spec.key: make(num_slots, *spec.shape, dtype=spec.dtype, device=device) for spec in specs
        }
        self.layers = sorted({spec.layer_idx for spec in specs})

    def tensor(self, layer_idx: int, kind: str, state_idx: int) -> torch.Tensor | None:
        return self.tensors.get((layer_idx, kind, state_idx))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def copy_slots(self, copies: list[tuple[int, int]]) -> None:
        """Copy each (source, destination) slot's states in every layer (forks), one gather and scatter
        per tensor."""
        if not copies:
            return
        device = next(iter(self.tensors.values())).device
        sources = torch.tensor([s for s, _ in copies], dtype=torch.int64, device=device)
        destinations = torch.tensor([d for _, d in copies], dtype=torch.int64, device=device)
        for tensor in self.tensors.values():
            tensor.index_copy_(0, destinations, tensor.index_select(0, sources))


def swap_states(
    device: StateCache, host: StateCache, out: list[tuple[int, int]], back: list[tuple[int, int]]
) -> None:
    """A step's state swaps: `out` (device slot, host slot) and `back` (host slot, device slot). Every
    source is read before any destination is written, so a slot freed and taken again in the same
    schedule (swapped out by one request, in by another) moves what it held before the step."""
    if not out and not back:
        return
    gathered = []
    for key, tensor in device.tensors.items():
        host_tensor = host.tensors[key]
        from_device = tensor[[d for d, _ in out]].to(host_tensor.device) if out else None
        from_host = host_tensor[[h for h, _ in back]].to(tensor.device) if back else None
        gathered.append((key, from_device, from_host))
    for key, from_device, from_host in gathered:
        if from_device is not None:
            host.tensors[key][[h for _, h in out]] = from_device
        if from_host is not None:
            device.tensors[key][[d for _, d in back]] = from_host
