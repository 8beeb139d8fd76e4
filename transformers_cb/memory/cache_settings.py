"""`CacheSettings`: the device KV cache of one engine, resolved before a byte is allocated.

The pages of every KV group (`CacheLayout`, the tensors' shape), each group's block-table width, the width
allocated up front and whether pages are shared between requests: what the page pools, the KV tensors and
the packer's block tables are built from (engine/build.py; part of the `EngineSettings`, engine/settings.py). The sizes come from the agreed `Sizing`, so
every tensor-parallel rank resolves the same settings.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..config.continuous_batching import ContinuousBatchingConfig
from ..kv.layer_groups import KVGroupSpec
from ..kv.page_policies import num_pages_for
from .kv_cache import CacheLayout
from .sizing import ModelShape, Sizing, resolve_group_pages


@dataclass(frozen=True)
class CacheSettings:
    """`layout`: the KV tensors (pages of each group: the sizes of the groups' page pools);
    `group_widths`: block-table width of each group; `initial_pages`: block-table width allocated up front
    (the workload's longest request; None: unknown); `sharing`: prefix sharing (and forks sharing their
    prompt's pages)."""

    layout: CacheLayout
    group_widths: tuple[int, ...]
    initial_pages: int | None
    sharing: bool

    @property
    def kv_groups(self) -> tuple[KVGroupSpec, ...]:
        return self.layout.groups

    @property
    def group_pages(self) -> tuple[int, ...]:
        """Pages of each KV group."""
        return self.layout.pages

    @property
    def page_size(self) -> int:
        return self.layout.page_size


def layout_of(
    shape: ModelShape,
    kv_groups: Sequence[KVGroupSpec],
    group_pages: Sequence[int],
    page_size: int,
    dtype: torch.dtype,
    device: torch.device,
    scratch_page: bool = False,
) -> CacheLayout:
    """The KV tensors' layout of a model of `shape` (the target's, or the draft model's own)."""
    return CacheLayout(
        num_layers=shape.num_layers,
        groups=tuple(kv_groups),
        pages=tuple(group_pages),
        page_size=page_size,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        dtype=dtype,
        device=device,
        scratch_page=scratch_page,
    )


def resolve_cache_settings(
    sizing: Sizing,
    kv_groups: tuple[KVGroupSpec, ...],
    shape: ModelShape,
    config: ContinuousBatchingConfig,
    workload: list[int] | None,
    dtype: torch.dtype,
    device: torch.device,
    scratch_page: bool,
    sharing: bool,
) -> CacheSettings:
    """The cache of `sizing`'s pages split over `kv_groups` (`resolve_group_pages`); `scratch_page`: one
    page more per group for CUDA graphs' padded rows."""
    group_pages, group_widths = resolve_group_pages(sizing, list(kv_groups), config, workload)
    layout = layout_of(shape, kv_groups, group_pages, sizing.page_size, dtype, device, scratch_page)
    return CacheSettings(
        layout=layout,
        group_widths=tuple(group_widths),
        initial_pages=num_pages_for(max(workload), sizing.page_size) if workload else None,
        sharing=sharing,
    )
