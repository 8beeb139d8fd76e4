"""The KV side of a model's parts, wired one way for the target and for the draft model: one page pool per
KV group beside that group's page policy (kv/), the page manager over them, the KV tensors (memory/) and
the packer with its block tables (runner/). `engine/build.py` wires the target's, `engine/speculation/assistant.py`
the draft model's, from their resolved settings."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..kv.layer_groups import KVGroupSpec
from ..kv.page_manager import PageManager
from ..kv.page_policies import PagePolicy, make_page_policy
from ..kv.pool import PagePool
from ..kv.rope_rule import RopeRule
from ..kv.state_slots import StateSlotPolicy
from ..memory.kv_cache import CacheLayout, PagedKVCache
from ..runner.packing import BatchPacker


@dataclass
class KVParts:
    """What `wire_kv` built: `policies[g]` owns `pools[g]` (kv/ owns pages); `pages` the page manager the
    planner talks to; `cache` the KV tensors; `packer` packs steps over them."""

    pools: list[PagePool]
    policies: list[PagePolicy]
    pages: PageManager
    cache: PagedKVCache
    packer: BatchPacker


def wire_kv(
    kv_groups: Sequence[KVGroupSpec],
    layout: CacheLayout,
    group_widths: Sequence[int],
    device: torch.device,
    sharing: bool = False,
    initial_pages: int | None = None,
    slots: StateSlotPolicy | None = None,
    rope: RopeRule | None = None,
) -> KVParts:
    """The KV parts of a model whose cache is `layout` (its `pages` per group sizing the pools), block
    tables `group_widths` wide per group (`initial_pages`: the rows' first width), prefix sharing on or off;
    `slots`: a model with state layers' slot group, behind the same page manager (kv/state_slots.py);
    `rope`: a dynamic rotary embedding's rule (kv/rope_rule.py), for the prefix keys and the packer."""
    pools = [PagePool(num_pages) for num_pages in layout.pages]
    policies = [
        make_page_policy(spec, pool, layout.page_size, g)
        for g, (spec, pool) in enumerate(zip(kv_groups, pools, strict=True))
    ]
    pages = PageManager(
        policies, list(kv_groups), sharing=sharing, page_size=layout.page_size, slots=slots, rope=rope
    )
    cache = PagedKVCache.from_layout(layout)
    packer = BatchPacker(cache, list(group_widths), device, initial_pages)
    packer.rope_rule = rope
    return KVParts(pools, policies, pages, cache, packer)
