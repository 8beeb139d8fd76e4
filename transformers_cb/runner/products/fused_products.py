"""Fused q/k/v and gate/up products from the model's own weights, for the run only.

A decoder layer computes `q_proj(x)`, `k_proj(x)`, `v_proj(x)` (and `gate_proj(x)`, `up_proj(x)`) on one
tensor: three products where one would do. Each oneDNN call costs ~18 us whatever its size
(`packed_linear.PackRule`), so on a 30-layer model one fused product per group saves ~90 calls a step.
The user's modules stay as they are: the group's members get the same kind of instance `forward` as
every packed Linear (`packed_model.packed_linears`), sharing one pack of their weights concatenated
along the outputs (`PackRegistry.current_fused`, rebuilt when any member's weight changes). The first
member called with an input computes the fused product and hands each other member its columns when
that member is called with the same input tensor (the same object, at the same address). When a member
is called on another input while a sibling's columns are still pending (cross-attention, layers that skip
their K/V projections), the group is unfused for the run; autograd recording and compiled forwards take the
member's own product too. A model whose code does not follow the pattern still gets exact results, only
unfused.

Groups are found by name: siblings `q_proj` / `k_proj` / `v_proj` and `gate_proj` / `up_proj` of one
parent module (Llama, Mistral, Qwen 2 / 3, Gemma 1-3, and every family that names them so), each a
packable Linear with the same input width, dtype and bias presence.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import torch
from torch import nn

from .packed_linear import PACKS, Pack, product

# Sibling names whose products read one input; the first that is present in full forms a group.
SIBLING_GROUPS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


@dataclass
class _Pending(threading.local):
    """The fused product of the last input, waiting for the members that have not taken their columns
    (per thread: two engines may run one model on two threads)."""

    input: torch.Tensor | None = None
    data_ptr: int = 0
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)

    def clear(self) -> None:
        self.input, self.outputs = None, {}


@dataclass
class FusedGroup:
    """Sibling Linears run as one packed product (`handle` names the fused pack in `PACKS`)."""

    members: tuple[nn.Linear, ...]
    handle: int
    pending: _Pending = field(default_factory=_Pending)
    # Set when a call broke the one-input pattern (`take`): members run their own products for the run.
    unfused: bool = False

    @property
    def in_features(self) -> int:
        return self.members[0].in_features

    @property
    def out_features(self) -> tuple[int, ...]:
        return tuple(m.out_features for m in self.members)

    @property
    def numel(self) -> int:
        return self.in_features * sum(self.out_features)

    def pack(self) -> Pack:
        # `_parameters` is what `m.weight` reads (members are plain Linears), without `nn.Module.__getattr__`
        params = [m._parameters for m in self.members]
        weights = tuple(cast(torch.Tensor, p["weight"]) for p in params)
        return PACKS.current_fused(self.handle, weights, tuple(p["bias"] for p in params))

    def take(self, index: int, input: torch.Tensor) -> torch.Tensor | None:
        """Member `index`'s product of `input`: its columns of the fused product (computed now, or by the
        sibling called first with the same input); None once the group is unfused for the run."""
        if self.unfused:
            return None
        pending = self.pending
        if pending.input is input and pending.data_ptr == input.data_ptr() and index in pending.outputs:
            output = pending.outputs.pop(index)
            if not pending.outputs:
                pending.clear()
            return output
        if pending.outputs:
            # A sibling never took its columns (its input was another tensor, or the model skips it, e.g.
            # layers reusing another layer's K/V): the pattern does not hold here, so every member runs its
            # own product from now on instead of a fused product per call.
            pending.clear()
            self.unfused = True
            return None
        pack = self.pack()
        fused = product(input, pack, pack.bias)
        outputs = fused.split(self.out_features, dim=-1)
        pending.input, pending.data_ptr = input, input.data_ptr()
        pending.outputs = {i: out for i, out in enumerate(outputs) if i != index}
        return outputs[index]


def find_groups(
    model: nn.Module, packable: Callable[[nn.Module], bool], handle_of: Callable[[nn.Linear], int]
) -> list[FusedGroup]:
    """The fusable sibling groups of `model` (each member `packable`, one input width, dtype and bias
    presence); `handle_of(first member)` gives each group's pack handle (the same one every run)."""
    groups = []
    for parent in model.modules():
        children = dict(parent.named_children())
        for names in SIBLING_GROUPS:
            members = [children.get(name) for name in names]
            if not all(isinstance(m, nn.Linear) and packable(m) for m in members):
                continue
            linears = tuple(m for m in members if isinstance(m, nn.Linear))
            first = linears[0]
            same = all(
                m.in_features == first.in_features
                and m.weight.dtype == first.weight.dtype
                and (m.bias is None) == (first.bias is None)
                for m in linears
            )
            if same:
                groups.append(FusedGroup(linears, handle_of(first)))
    return groups
