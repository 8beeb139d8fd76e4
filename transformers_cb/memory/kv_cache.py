"""`PagedKVCache`: the KV tensors, one pair per layer, addressed by slot within the layer's group.

A slot is one token position of one page: `slot = page_id * page_size + offset`.
Each layer stores keys and values as `[num_pages * page_size, num_kv_heads, head_dim]`
so that gathering a sequence's KV is one `index_select` over slots. Layers are
split into KV groups (`layer_groups.py`); a layer's tensors have as many pages as its
group's `PagePool`. The pools (who owns which page) are kv/'s, created beside the page
policies by the engine's builder (engine/build.py): the cache holds bytes only, and is told
how many pages each group has (`CacheLayout`, resolved before anything is allocated).

An int8 cache (`CacheLayout.dtype` int8: `kv_cache_dtype="int8"`) stores each token's K and V rows
quantized per KV head (memory/kv_quant.py) with their float32 scales in side tensors shaped like the pages
less the head dim (`scale_tensors`, per-layer views `key_scales` / `value_scales`): whatever moves a page
(forks' copies, swaps, release) moves its scales.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..invariants import check
from ..kv.layer_groups import FULL_ATTENTION, KVGroupSpec, layer_to_group
from .kv_quant import SCALE_BYTES, SCALE_DTYPE, quantize
from .released_tensors import TensorSpec, release_in_place, restore_in_place
from .zeroed import zeroed


@dataclass(frozen=True)
class CacheLayout:
    """The shape of the KV tensors, known before a byte is allocated (the engine's settings hold it).

    `pages[g]`: pages of group `g` (its pool's size); `scratch_page`: one more page per group, outside
    its pool, for CUDA graphs' padded rows. `num_kv_heads` x `head_dim`: the head shape of every group
    whose spec has none (`KVGroupSpec.head_shape`: per-layer head shapes). `dtype`: the pages' storage
    dtype (int8: quantized pages with a float32 scale per token, head and stream: `quantized`)."""

    num_layers: int
    groups: tuple[KVGroupSpec, ...]
    pages: tuple[int, ...]
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    scratch_page: bool = False

    @property
    def quantized(self) -> bool:
        """Pages of int8 with float32 scales beside them (memory/kv_quant.py)."""
        return self.dtype == torch.int8

    def head_shape(self, group: int) -> tuple[int, int]:
        """(KV heads, head dim) of group `group`'s layers (K's, as cached: before a layer's K/V repeat)."""
        return self.groups[group].head_shape or (self.num_kv_heads, self.head_dim)

    def row_shape(self, group: int) -> tuple[int, int]:
        """(heads, values per head) of one token's row in one stream of group `group`'s tensor: K's head
        shape, or K's and V's head sizes side by side when V's is not K's (`KVGroupSpec.value_dim`), or a
        latent row and the indexer's key after it (`KVGroupSpec.index_dim`)."""
        heads, dim = self.head_shape(group)
        spec = self.groups[group]
        return heads, dim + (spec.value_dim or 0) + (spec.index_dim or 0)

    def group_page_bytes(self, group: int) -> int:
        """Bytes of one page of group `group`: K and V of each of its layers (a latent group: its latent
        vectors alone, `KVGroupSpec.kv_streams`; V of its own size beside K: one row of both; an int8
        cache: its rows' scales too)."""
        element_size = torch.tensor([], dtype=self.dtype).element_size()
        layers = len(self.groups[group].layer_indices)
        heads, dim = self.row_shape(group)
        row_bytes = dim * element_size + (SCALE_BYTES if self.quantized else 0)
        return self.groups[group].kv_streams * layers * self.page_size * heads * row_bytes

    def page_bytes(self) -> int:
        """Bytes of one page in every group (a host page id exists in each group's pool)."""
        return sum(self.group_page_bytes(g) for g in range(len(self.groups)))

    def bytes_per_token(self) -> int:
        """KV bytes one token holds in every group (a multi-latent model: its latent, not decompressed K/V)."""
        return self.page_bytes() // self.page_size

    def nbytes(self) -> int:
        """Bytes of the whole cache, scratch pages included."""
        scratch = int(self.scratch_page)
        return sum((n + scratch) * self.group_page_bytes(g) for g, n in enumerate(self.pages))


def layer_views(
    storage: torch.Tensor, index: int, key_dim: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer `index` of a KV group's tensor `[2, layers, pages, page_size, Hkv, D]` as its key and value
    caches `[slots, Hkv, D]` (views: writes land in the group's tensor). A latent group's tensor has one
    stream (`[1, ...]`): its value cache is its key cache, so nothing decompressed is ever stored.

    `key_dim`: K's head size in a one-stream tensor whose rows are K then V (a V head size other than K's:
    `KVGroupSpec.value_dim`); the two caches are then strided views of one row `[slots, Hkv, D_k + D_v]`."""
    heads, dim = storage.shape[-2:]
    if key_dim is not None and key_dim < dim:
        rows = storage[0, index].view(-1, heads, dim)
        return rows[..., :key_dim], rows[..., key_dim:]
    return storage[0, index].view(-1, heads, dim), storage[-1, index].view(-1, heads, dim)


def scale_views(scales: torch.Tensor, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer `index` of a group's scale tensor `[2, layers, pages, page_size, Hkv]` as its key and value
    scales `[slots, Hkv]` (views)."""
    heads = scales.shape[-1]
    return scales[0, index].view(-1, heads), scales[-1, index].view(-1, heads)


def write_slots(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Store `key`/`value` `[num_tokens, Hkv, D]` at `slot_mapping` of one layer's caches, in their dtype;
    an int8 cache quantized per (token, head), its `scales` (key's, value's `[slots, Hkv]`) written beside."""
    if scales is None:
        key_cache.index_copy_(0, slot_mapping, key.to(key_cache.dtype))
        value_cache.index_copy_(0, slot_mapping, value.to(value_cache.dtype))
        return
    for cache, scale_cache, rows in ((key_cache, scales[0], key), (value_cache, scales[1], value)):
        q, scale = quantize(rows)
        cache.index_copy_(0, slot_mapping, q)
        scale_cache.index_copy_(0, slot_mapping, scale)


class PagedKVCache:
    """KV storage for `num_layers` layers (`from_layout`: the same from a `CacheLayout`).

    Args:
        num_pages: pages of each group (an int for all groups, or one per group): the sizes of the
            groups' page pools, which live with the page policies (kv/), not here.
        groups: the KV layer groups; None means one full-attention group of every layer.
        scratch_page: one extra page per group, outside its pool, that the padded rows of a CUDA graph
            step write to and nothing reads (`scratch_page_id`).
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int | list[int],
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        groups: list[KVGroupSpec] | None = None,
        scratch_page: bool = False,
    ) -> None:
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        # An empty list is no group at all (a pure state-space model); None is the default group.
        self.groups = (
            groups if groups is not None else [KVGroupSpec(FULL_ATTENTION, tuple(range(num_layers)))]
        )
        # Layers of no group (state-only layers of a hybrid: memory/state_cache.py) have no K/V here.
        self.layer_group = layer_to_group(
            self.groups, num_layers, [layer for spec in self.groups for layer in spec.layer_indices]
        )
        pages_per_group = num_pages if isinstance(num_pages, list) else [num_pages] * len(self.groups)
        check(len(pages_per_group) == len(self.groups), f"{pages_per_group} pages for groups {self.groups}")
        self.layout = CacheLayout(
            num_layers,
            tuple(self.groups),
            tuple(pages_per_group),
            page_size,
            num_kv_heads,
            head_dim,
            dtype,
            torch.device(device),
            scratch_page,
        )
        self.has_scratch_page = scratch_page
        # One tensor per group, `[2 (K, V; 1 for a latent group or one whose V is not K's size), layers of the group, pages (+ 1 scratch page), page_size, kv heads,
        # head_dim]` (the group's row shape: `CacheLayout.row_shape`), so that moving pages between tiers (kv/offload.py, swap.py) is one copy per group; each layer's K
        # and V are views `[num_slots, num_kv_heads, head_dim]` of it. Zero-filled so that padded gathers never
        # read NaN/inf (on CPU paid per page touched: memory/zeroed.py). The scratch page (CUDA graphs' padded
        # rows) sits after every pool page.
        self.group_tensors = [
            zeroed(
                (
                    spec.kv_streams,
                    len(spec.layer_indices),
                    n + int(scratch_page),
                    page_size,
                    *self.layout.row_shape(g),
                ),
                dtype,
                device,
            )
            for g, (spec, n) in enumerate(zip(self.groups, pages_per_group, strict=True))
        ]
        # An int8 cache: one float32 scale per (stream, layer, slot, KV head), zero-filled (a zero page reads 0).
        self.scale_tensors = [
            zeroed(t.shape[:-1], SCALE_DTYPE, device)
            for t in (self.group_tensors if self.layout.quantized else [])
        ]
        self.key_scales: list[torch.Tensor] = [torch.empty(0)] * num_layers
        self.value_scales: list[torch.Tensor] = [torch.empty(0)] * num_layers
        self.keys: list[torch.Tensor] = [torch.empty(0)] * num_layers
        self.values: list[torch.Tensor] = [torch.empty(0)] * num_layers
        self._index_in_group = [0] * num_layers
        self._set_views()
        # What `release()` gave back (None while the tensors are held): the group tensors, then the scales.
        self._released: list[TensorSpec] | None = None
        self._released_scales: list[TensorSpec] = []

    def _set_views(self) -> None:
        for g, spec in enumerate(self.groups):
            storage = self.group_tensors[g]
            for i, layer in enumerate(spec.layer_indices):
                self._index_in_group[layer] = i
                self.keys[layer], self.values[layer] = layer_views(storage, i, self.key_dim(g))
                if self.scale_tensors:
                    self.key_scales[layer], self.value_scales[layer] = scale_views(self.scale_tensors[g], i)

    @property
    def released(self) -> bool:
        return self._released is not None

    def release(self) -> int:
        """Give the group tensors' memory back (in place: memory/released_tensors.py); the per-layer views
        go with them. Returns the bytes freed (0 when already released). No page may hold KV the engine
        still needs (`Scheduler.drop_all_kv`)."""
        if self._released is not None:
            return 0
        freed = self.nbytes()
        self.keys[:] = [torch.empty(0)] * len(self.keys)
        self.values[:] = [torch.empty(0)] * len(self.values)
        # The scale views too: a view held would keep its released tensor's memory alive.
        self.key_scales[:] = [torch.empty(0)] * len(self.key_scales)
        self.value_scales[:] = [torch.empty(0)] * len(self.value_scales)
        self._released = release_in_place(self.group_tensors)
        self._released_scales = release_in_place(self.scale_tensors)
        return freed

    def restore(self) -> None:
        """Allocate the group tensors again (zero-filled, same shapes) and their per-layer views."""
        if self._released is None:
            return
        restore_in_place(self.group_tensors, self._released, zero=True)
        restore_in_place(self.scale_tensors, self._released_scales, zero=True)
        self._released = None
        self._set_views()

    @classmethod
    def from_layout(cls, layout: CacheLayout) -> PagedKVCache:
        return cls(
            layout.num_layers,
            list(layout.pages),
            layout.page_size,
            layout.num_kv_heads,
            layout.head_dim,
            layout.dtype,
            layout.device,
            list(layout.groups),
            scratch_page=layout.scratch_page,
        )

    def key_dim(self, group: int) -> int | None:
        """K's head size where group `group`'s rows hold K and V side by side, or a latent row and its
        indexer key (`layer_views`: the layer's value cache is then V, or the indexer keys); else None."""
        spec = self.groups[group]
        split = spec.value_dim is not None or spec.index_dim is not None
        return self.layout.head_shape(group)[1] if split else None

    @property
    def pages_per_group(self) -> tuple[int, ...]:
        """Pages of each group, scratch page excluded (the sizes of the groups' pools)."""
        return self.layout.pages

    def scratch_page_id(self, group: int) -> int:
        """The page past group `group`'s pool (needs `scratch_page=True`)."""
        check(self.has_scratch_page, "the cache was built without a scratch page")
        return self.layout.pages[group]

    def write(
        self, layer_idx: int, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> None:
        """Store `key`/`value` `[num_tokens, num_kv_heads, head_dim]` at `slot_mapping` `[num_tokens]`
        (quantized, with their scales, in an int8 cache)."""
        write_slots(
            self.keys[layer_idx],
            self.values[layer_idx],
            slot_mapping,
            key,
            value,
            self.layer_scales(layer_idx),
        )

    @property
    def quantized(self) -> bool:
        return self.layout.quantized

    def layer_scales(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layer `layer_idx`'s key and value scales `[slots, Hkv]` in an int8 cache; None otherwise."""
        if not self.scale_tensors:
            return None
        return self.key_scales[layer_idx], self.value_scales[layer_idx]

    def copy_pages(self, copies: list[tuple[int, int, int]]) -> None:
        """Run page copies `(group, source page, destination page)`: one batched copy per layer."""
        by_group: dict[int, tuple[list[int], list[int]]] = {}
        for group, source, destination in copies:
            sources, destinations = by_group.setdefault(group, ([], []))
            sources.append(source)
            destinations.append(destination)
        offsets = torch.arange(self.page_size, device=self.keys[0].device)
        for group, (sources, destinations) in by_group.items():
            device = self.keys[0].device
            src = (torch.tensor(sources, device=device)[:, None] * self.page_size + offsets).reshape(-1)
            dst = (torch.tensor(destinations, device=device)[:, None] * self.page_size + offsets).reshape(-1)
            storage = self.group_tensors[group]
            for index, layer in enumerate(self.groups[group].layer_indices):
                if storage.shape[0] == 1:  # one stream: whole rows (K and V, or a latent and its indexer key)
                    rows = storage[0, index].view(-1, *storage.shape[-2:])
                    rows.index_copy_(0, dst, rows.index_select(0, src))
                    continue
                self.keys[layer].index_copy_(0, dst, self.keys[layer].index_select(0, src))
                self.values[layer].index_copy_(0, dst, self.values[layer].index_select(0, src))
            if self.scale_tensors:  # an int8 cache: the pages' scales with them, every layer at once
                scales = self.scale_tensors[group]
                rows = scales.view(scales.shape[0], scales.shape[1], -1, scales.shape[-1])
                rows.index_copy_(2, dst, rows.index_select(2, src))

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[layer_idx], self.values[layer_idx]

    def storage_of(self, layer_idx: int) -> tuple[torch.Tensor, int]:
        """The group tensor holding layer `layer_idx`'s K/V, and the layer's index inside it."""
        return self.group_tensors[self.layer_group[layer_idx]], self._index_in_group[layer_idx]

    def scales_of(self, layer_idx: int) -> torch.Tensor | None:
        """The scale tensor of layer `layer_idx`'s group in an int8 cache (indexed like `storage_of`)."""
        return self.scale_tensors[self.layer_group[layer_idx]] if self.scale_tensors else None

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [*self.group_tensors, *self.scale_tensors])
