"""DeepSeek sparse attention (DeepSeek V3.2, GLM-MoE-DSA, HY-V4, AXK2, Mistral Large 4): the indexer's keys
in the latent pages, each query's top-k keys chosen from them, the attention masked to those keys.

An `indexed_attention` layer is a multi-latent layer (attention/families/latent.py) whose module also owns an
indexer: a light scorer with a key of its own per token (`index_head_dim` values, kept by transformers in
`past_key_values.update_indexer`) that picks, for each query, the `index_topk` cached keys its attention
reads. Here the indexer's key of a token is stored after the token's latent row in the layer's pages (the
group's `KVGroupSpec.index_dim` columns: `memory.kv_cache.layer_views` gives them as the layer's value
cache), so page moves, forks, swaps and prefix hits carry them with the latent, and sizing counts them.

The seam is the indexer module itself, handed through for the run (`indexer_pass_through`, entered with the
paged backend by attention/selection.py; `IndexerThrough`): inside a continuous-batching forward, the module's
own `forward` runs once per request of the packed step (`segments`: its rows, their positions, the slots
of its keys 0..L-1) with a causal mask of that request's keys and a cache stand-in (`_IndexerKeys`) whose
`update_indexer` writes the new indexer keys into the pages and returns the request's cached ones, exactly
the keys `generate()`'s cache returns. Its top-k (positions 0..L-1 of the request's keys) is packed back
into `[1, T, index_topk]` (-1: no key), which the MLA module passes to the attention interface as
`indices` (what transformers hands a sparse kernel); `latent.latent_attention` then attends each request's
decompressed keys masked to its causal and selected ones (`selected_mask`). The scoring, rotary embedding
and top-k stay the module's own code; anywhere else (a plain `generate()`, the support check's probe) the
module runs as its class does.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from ...invariants import present
from ...patches import patched
from ..metadata import STEP_METADATA, AttentionMetadata, GroupMetadata

PATCH_KIND = "indexer_pass_through"  # its counted patches (patches.py)

# The indexer modules of each model (found once: the session installs and removes their pass-through).
_modules: weakref.WeakKeyDictionary[torch.nn.Module, list[torch.nn.Module]] = weakref.WeakKeyDictionary()
# What an indexer's forward must take, by name, for the pass-through to hand it one request at a time.
INDEXER_ARGUMENTS = ("hidden_states", "attention_mask", "past_key_values")


def is_indexer(module: torch.nn.Module) -> bool:
    """A DeepSeek sparse attention indexer (`index_topk`, a `layer_idx`, a forward scoring cached keys)."""
    return isinstance(getattr(module, "index_topk", None), int) and isinstance(
        getattr(module, "layer_idx", None), int
    )


def indexer_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's indexer modules, in module order."""
    found = _modules.get(model)
    if found is None:
        found = [m for m in model.modules() if is_indexer(m)]
        _modules[model] = found
    return found


def indexer_problem(module: torch.nn.Module) -> str | None:
    """Why `module`'s selection cannot be handed one request at a time (None: it can)."""
    parameters = inspect.signature(type(module).forward).parameters
    missing = [name for name in INDEXER_ARGUMENTS if name not in parameters]
    if missing:
        return f"{type(module).__name__}.forward takes no {missing}"
    if getattr(module, "index_kpool", None) is not None:
        # GLM-5-next: `update_indexer` caches [key, pooling gate scores, validity] and the indexer reads the
        # attention cache's own layer (`past_key_values.layers`), neither of which a request's stream holds.
        return (
            f"{type(module).__name__} selects pools of index_kpool keys, caching each token's key with its "
            "pooling gate scores and a validity channel and reading the attention cache's layer length: the "
            "paged indexer keys hold the key alone"
        )
    return None


@dataclass(frozen=True)
class Segment:
    """One request's queries in a packed step: rows `[start, end)`, consecutive positions from `first`, and
    the slots of its keys 0..L-1 (L = the last query's position + 1)."""

    start: int
    end: int
    first: int
    key_slots: torch.Tensor  # [L] int64


def segments(metadata: AttentionMetadata, group: GroupMetadata) -> list[Segment]:
    """Every request's queries of the step in a full-attention group: the native run's tokens (by block-table
    row), each decode, each prefill chunk."""
    found = []
    page_size = metadata.cache.page_size
    if metadata.native_tokens:
        rows = present(metadata.token_row, "native tokens without their rows").tolist()
        positions = present(metadata.token_pos, "native tokens without their positions").tolist()
        start = 0
        for t in range(1, len(rows) + 1):
            if t == len(rows) or rows[t] != rows[start]:
                last = positions[t - 1]
                keys = torch.arange(last + 1, device=group.block_table.device)
                pages = group.block_table[rows[start]].long()[keys // page_size]
                found.append(Segment(start, t, positions[start], pages * page_size + keys % page_size))
                start = t
    for decode in group.decode_groups:
        for b in range(decode.q_end - decode.q_start):
            length = decode.kv_slots.shape[1]
            if decode.kv_mask is not None:
                length = int(decode.kv_mask[b].sum())
            row = decode.q_start + b
            found.append(Segment(row, row + 1, length - 1, decode.kv_slots[b, :length]))
    for chunk in group.prefill_groups:
        slots = (
            chunk.kv_slots if chunk.kv_slots is not None else group.slot_mapping[chunk.q_start : chunk.q_end]
        )
        found.append(Segment(chunk.q_start, chunk.q_end, chunk.past_len, slots))
    return found


class _IndexerKeys:
    """The cache stand-in one request's indexer call gets: `update_indexer` writes the request's new indexer
    keys `[1, S, D]` into the pages and returns its keys 0..L-1 `[1, L, D]`, as transformers' cache does."""

    def __init__(self, index_cache: torch.Tensor, new_slots: torch.Tensor, key_slots: torch.Tensor) -> None:
        self.index_cache = index_cache
        self.new_slots = new_slots
        self.key_slots = key_slots

    def update_indexer(self, keys: torch.Tensor, layer_idx: int) -> torch.Tensor:
        width = self.index_cache.shape[-1]
        self.index_cache.index_copy_(
            0, self.new_slots, keys[0].reshape(-1, 1, width).to(self.index_cache.dtype)
        )
        return self.index_cache.index_select(0, self.key_slots).view(1, -1, width).to(keys.dtype)


def _rows(value: Any, tokens: int, rows: slice) -> Any:
    """`value` cut to the rows of one request where it is a per-token tensor `[1, T, ...]` (or a tuple of them)."""
    if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == tokens:
        return value[:, rows]
    if isinstance(value, tuple) and all(isinstance(v, torch.Tensor) for v in value):
        return tuple(_rows(v, tokens, rows) for v in value)
    return value


class IndexerThrough:
    """An indexer's `forward` for a run: inside a continuous-batching forward, its class's forward once per
    request over that request's cached indexer keys (module docstring); anywhere else, its class's forward."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self.signature = inspect.signature(type(module).forward)

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        metadata = STEP_METADATA.get()
        forward = type(self.module).forward
        if not isinstance(metadata, AttentionMetadata):
            return forward(self.module, *args, **kwargs)
        bound = self.signature.bind(self.module, *args, **kwargs)
        arguments = bound.arguments
        hidden = arguments["hidden_states"]
        tokens = hidden.shape[1]
        layer = self.module.layer_idx
        group = metadata.group_of(layer)
        _, index_cache = metadata.cache.layer(layer)
        picked = torch.full((1, tokens, self.module.index_topk), -1, dtype=torch.int32, device=hidden.device)
        for segment in segments(metadata, group):
            rows = slice(segment.start, segment.end)
            length = segment.key_slots.shape[0]
            positions = torch.arange(segment.first, segment.first + segment.end - segment.start)
            causal = torch.arange(length)[None, :] <= positions[:, None]
            call = {name: _rows(value, tokens, rows) for name, value in arguments.items() if name != "self"}
            call["attention_mask"] = causal[None].to(hidden.device)
            call["past_key_values"] = _IndexerKeys(index_cache, group.slot_mapping[rows], segment.key_slots)
            chosen = forward(self.module, **call)  # [1, S, min(index_topk, L)]
            picked[0, rows, : chosen.shape[-1]] = chosen[0].to(torch.int32)
        return picked


@contextmanager
def indexer_pass_through(model: torch.nn.Module) -> Iterator[None]:
    """Inside: every indexer of `model` selects from the paged indexer keys in a continuous-batching forward
    (an instance `forward`, `IndexerThrough`: a counted patch, patches.py, shared by overlapping runs and
    removed by the last)."""
    with patched(PATCH_KIND, [(m, "forward", partial(IndexerThrough, m)) for m in indexer_modules(model)]):
        yield


def selected_mask(indices: torch.Tensor, rows: slice, first: int, length: int) -> torch.Tensor:
    """`[1, 1, S, L]` bool: query `i` of rows `rows` (position `first + i`) attends key `j` when `j` is at or
    before it and among its selected keys `indices[0, rows]` (positions; -1: none)."""
    chosen = indices[0, rows].long()  # [S, k]
    count = chosen.shape[0]
    spare = torch.full_like(chosen, length)  # unselected entries land in a dropped extra column
    columns = torch.where(chosen >= 0, chosen, spare).clamp(max=length)
    selected = torch.zeros(count, length + 1, dtype=torch.bool, device=indices.device)
    selected.scatter_(1, columns, True)
    positions = torch.arange(first, first + count, device=indices.device)
    causal = torch.arange(length, device=indices.device)[None, :] <= positions[:, None]
    return (selected[:, :length] & causal).view(1, 1, count, length)
