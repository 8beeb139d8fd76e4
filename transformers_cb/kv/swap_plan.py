"""`SwapPlan`: the swaps one step decided, as plain page ids (device <-> host), per KV layer group.

Planned by `CpuOffload` (offload.py) during `schedule()`, carried by the step's `StepPlan`
(and, under tensor parallelism, by rank 0's step message), executed by the runner's `SwapCopier`
(memory/swap.py) on every rank's own KV shard.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SwapPlan:
    """Per KV group `g`: `out_src[g][i]` (device page) goes to `out_dst[g][i]` (host page),
    `in_src[g][i]` (host page) goes to `in_dst[g][i]` (device page)."""

    num_groups: int
    out_src: list[list[int]] = field(default_factory=list)
    out_dst: list[list[int]] = field(default_factory=list)
    in_src: list[list[int]] = field(default_factory=list)
    in_dst: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        for lists in (self.out_src, self.out_dst, self.in_src, self.in_dst):
            lists.extend([] for _ in range(self.num_groups - len(lists)))

    @property
    def is_empty(self) -> bool:
        return not any(self.out_src) and not any(self.in_src)

    @property
    def num_out_pages(self) -> int:
        return sum(len(ids) for ids in self.out_src)

    @property
    def num_in_pages(self) -> int:
        return sum(len(ids) for ids in self.in_src)
