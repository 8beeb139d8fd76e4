"""`SwapPlan`: the swaps one step decided, as plain page ids (device <-> host), per page group.

Planned by `CpuOffload` (offload.py) during `schedule()`, carried by the step's `StepPlan`
(and, under tensor parallelism, by rank 0's step message), executed by the runner on every rank: the
KV groups by its `SwapCopier` (memory/swap.py) on the rank's own KV shard, the state-slot group of a
model with state layers (the group after the KV groups, `PageManager.slot_group`) by
`memory.state_cache.swap_states`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SwapPlan:
    """Per group `g`: `out_src[g][i]` (device page) goes to `out_dst[g][i]` (host page),
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

    def head(self, num_groups: int) -> SwapPlan:
        """The swaps of the first `num_groups` groups (the KV groups, without a slot group after them)."""
        if num_groups == self.num_groups:
            return self
        return SwapPlan(
            num_groups,
            self.out_src[:num_groups],
            self.out_dst[:num_groups],
            self.in_src[:num_groups],
            self.in_dst[:num_groups],
        )

    def pairs(self, group: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """Group `group`'s swaps as (device, host) pairs out and (host, device) pairs in; none past the plan's groups."""
        if group >= self.num_groups:
            return [], []
        out = list(zip(self.out_src[group], self.out_dst[group], strict=True))
        back = list(zip(self.in_src[group], self.in_dst[group], strict=True))
        return out, back

    @property
    def num_out_pages(self) -> int:
        return sum(len(ids) for ids in self.out_src)

    @property
    def num_in_pages(self) -> int:
        return sum(len(ids) for ids in self.in_src)
