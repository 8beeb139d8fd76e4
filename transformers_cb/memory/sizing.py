"""Sizing the cache and the step buffers from free memory and, when known, the work.

Rules (SPEC section 4):
- memory budget = free device memory (`torch.cuda.mem_get_info` on CUDA, psutil
  `available` on CPU) x `max_memory_percent` (auto: 0.9 on CUDA, 0.5 on CPU);
- `max_batch_tokens` = 8192 by default, lowered so step activations take at most
  a fifth of the budget, never below 256;
- `max_requests_per_batch` = number of prompts (fallback 1024), capped so the
  fp32 logits buffer fits in the same share;
- `num_blocks` fills the rest of the budget; on CPU it is also capped to the work
  (all known requests at full length, plus the safety margin's share so that the
  margin never holds back a job that fits) or, with no workload known, to 512 MiB,
  so set-up stays fast and the cache fits the job rather than all RAM;
- a model with state layers (docs/state_layers.md) gets one state slot per request that may run at
  once (`max_requests_per_batch`), within half of the cache's budget, before the pages take the rest;
- a draft model (`assistant_model`) gets as many pages as the model, from the same budget;
- an int8 KV cache (`kv_cache_dtype="int8"`) counts a token's K/V as one byte a value plus a float32 scale
  per KV head and stream (memory/kv_quant.py): about 2x (bf16) / 4x (fp32) the pages in the same budget;
- per KV layer group (`resolve_group_pages`): full-attention groups get `num_blocks`
  pages; a sliding-window group, whose requests hold only their window, gets what
  the known workload needs at most (capped by `num_blocks`).
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch

from ..config.continuous_batching import ContinuousBatchingConfig
from ..kv.layer_groups import (
    INDEXED_ATTENTION,
    KVGroupSpec,
    ObservedLayers,
    kv_layer_indices,
    latent_shape_of,
    layer_head_shapes,
    layer_types_of,
)
from ..kv.page_policies import num_pages_for
from ..kv.rope_rule import rope_rule_of
from .kv_quant import INT8, SCALE_BYTES

DEFAULT_MAX_BATCH_TOKENS = 8192
MIN_MAX_BATCH_TOKENS = 256
FALLBACK_MAX_REQUESTS = 1024
CPU_CACHE_CAP_BYTES = 512 * 2**20
BATCH_SHARE = 0.2


def native_positions(config) -> int:
    """The longest sequence a request may reach: the config's `max_position_embeddings`, unbounded
    without one or when the rotary embedding extends past it the way `generate()` runs it (LongRoPE,
    dynamic NTK: kv/rope_rule.py)."""
    rule = rope_rule_of(config)
    if rule is not None and rule.extends_positions:
        return 2**31 - 1
    return getattr(config, "max_position_embeddings", None) or 2**31 - 1


def query_heads_per_kv_head(config) -> int:
    """The query heads that share one KV head in `config`'s attention (1 without grouped queries); 0 when
    the config does not say one number for every layer (per-layer head counts: Gemma 4)."""
    config = config.get_text_config()
    try:
        heads = getattr(config, "num_attention_heads", None) or getattr(config, "num_heads", None) or 1
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
    except (AttributeError, RuntimeError):  # per-layer counts: AmbiguousGlobalPerLayerAttributeError
        return 0
    return max(1, int(heads) // int(kv_heads))


@dataclass(frozen=True)
class ModelShape:
    """The model's sizes the cache and step buffers are sized from.

    `layer_head_shapes`: (KV heads, head dim) of each layer when they differ per layer (`per_layer_config`,
    read per layer: reading them globally raises transformers' `AmbiguousGlobalPerLayerAttributeError`);
    empty when every layer has `num_kv_heads` x `head_dim` (then those of layer 0 otherwise), or the K head
    shapes the model's forward showed (`ObservedLayers`). `layer_value_dims`: each layer's V head size when
    some layer's is not its K's (MiMo-V2-Flash: 128 against 192; empty: V has K's size)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    layer_head_shapes: tuple[tuple[int, int], ...] = ()
    # The layers that cache K/V (None: every layer; a hybrid's state-only layers cache none).
    kv_layers: tuple[int, ...] | None = None
    # (kv_lora_rank, qk_rope_head_dim) of a multi-latent attention model: each layer caches one latent
    # vector per token (one head of their summed width, no V), not decompressed K/V.
    latent: tuple[int, int] | None = None
    layer_value_dims: tuple[int, ...] = ()
    # DeepSeek sparse attention: the indexer's key size cached beside the latent, per layer (0: none).
    layer_index_dims: tuple[int, ...] = ()

    @classmethod
    def from_config(cls, config, observed: ObservedLayers | None = None) -> ModelShape:
        """The shape `config` states, with the head shapes the model's forward showed (`observed`) instead
        of the config's when given."""
        config = config.get_text_config()
        # State-space models (Mamba) have no attention heads: their shape only sizes the step buffers.
        num_heads = getattr(config, "num_attention_heads", None) or getattr(config, "num_heads", None) or 1
        hidden = config.hidden_size
        per_layer = (
            list(observed.head_shapes) if observed is not None and observed.head_shapes else None
        ) or layer_head_shapes(config)
        kv_layers = kv_layer_indices(config)
        latent = latent_shape_of(config)
        value_dims = observed.value_dims if observed is not None else ()
        index_dims: tuple[int, ...] = ()
        if latent is not None:
            per_layer = [(1, sum(latent))] * config.num_hidden_layers
            value_dims = ()
            index_dim = int(getattr(config, "index_head_dim", None) or 0)
            index_dims = tuple(index_dim if t == INDEXED_ATTENTION else 0 for t in layer_types_of(config))
        if per_layer:
            num_kv_heads, head_dim = per_layer[0]
        else:
            num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
            head_dim = getattr(config, "head_dim", None) or hidden // num_heads
        return cls(
            num_layers=config.num_hidden_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            hidden_size=hidden,
            intermediate_size=getattr(config, "intermediate_size", None) or 4 * hidden,
            vocab_size=config.vocab_size,
            max_position_embeddings=native_positions(config),
            layer_head_shapes=tuple(per_layer or ()),
            kv_layers=None if len(kv_layers) == config.num_hidden_layers else tuple(kv_layers),
            latent=latent,
            layer_value_dims=tuple(value_dims),
            layer_index_dims=index_dims if any(index_dims) else (),
        )

    def layer_head_shape(self, layer_idx: int) -> tuple[int, int]:
        """(KV heads, head dim) of layer `layer_idx`."""
        if self.layer_head_shapes:
            return self.layer_head_shapes[layer_idx]
        return self.num_kv_heads, self.head_dim

    def layer_value_dim(self, layer_idx: int) -> int:
        """V's head size in layer `layer_idx` (its K's unless the forward showed otherwise)."""
        if self.layer_value_dims:
            return self.layer_value_dims[layer_idx]
        return self.layer_head_shape(layer_idx)[1]

    def kv_bytes_per_token(self, element_size: int, scale_bytes: int = 0) -> int:
        """K and V of one token in every layer that caches them (each layer with its own head shape, V with
        its own head size); a multi-latent model's latent vector alone (`kv_lora_rank + qk_rope_head_dim`
        per layer). `scale_bytes`: an int8 cache's scale per KV head of K and of V (memory/kv_quant.py)."""
        layers = range(self.num_layers) if self.kv_layers is None else self.kv_layers
        if self.latent is not None:
            indexer = sum(self.layer_index_dims[i] for i in layers) if self.layer_index_dims else 0
            return (sum(h * d for h, d in map(self.layer_head_shape, layers)) + indexer) * element_size
        elements = scales = 0
        for layer in layers:
            heads, dim = self.layer_head_shape(layer)
            elements += heads * (dim + self.layer_value_dim(layer))
            scales += 2 * heads
        return elements * element_size + scales * scale_bytes

    def activation_bytes_per_token(self, element_size: int) -> int:
        # hidden + residual + q/k/v/o + MLP intermediates (gate, up, act), a rough upper bound.
        return (6 * self.hidden_size + 3 * self.intermediate_size) * element_size


@dataclass(frozen=True)
class Sizing:
    num_pages: int
    page_size: int
    max_batch_tokens: int
    max_requests_per_batch: int
    max_pages_per_request: int
    # Per-request state slots of a model with state layers (0: none; memory/state_cache.py).
    num_state_slots: int = 0


# max_memory_percent's auto values: the share of free memory the cache and the step buffers take.
CUDA_MEMORY_PERCENT = 0.9
CPU_MEMORY_PERCENT = 0.5


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return int(psutil.virtual_memory().available)


def resolve_sizing(
    config: ContinuousBatchingConfig,
    shape: ModelShape,
    device: torch.device,
    dtype: torch.dtype,
    workload: list[int] | None = None,
    state_bytes_per_slot: int = 0,
    extra_kv_bytes_per_token: int = 0,
) -> Sizing:
    """Args: workload: the KV length each known request reaches at most (None: unknown, e.g. a server);
    state_bytes_per_slot: one request's recurrent state in every state layer (0: no state layers);
    extra_kv_bytes_per_token: KV bytes per token of pages held beside each of the model's, out of the same
    budget (a draft model's, engine/speculation/assistant.py: it gets as many pages)."""
    element_size = torch.tensor([], dtype=dtype).element_size()
    percent = config.max_memory_percent or (
        CUDA_MEMORY_PERCENT if device.type == "cuda" else CPU_MEMORY_PERCENT
    )
    budget = int(free_memory_bytes(device) * percent)
    batch_budget = int(budget * BATCH_SHARE)

    max_batch_tokens = config.max_batch_tokens
    if max_batch_tokens is None:
        by_memory = batch_budget // max(1, shape.activation_bytes_per_token(element_size))
        max_batch_tokens = max(MIN_MAX_BATCH_TOKENS, min(DEFAULT_MAX_BATCH_TOKENS, by_memory))

    max_requests = config.max_requests_per_batch
    if max_requests is None:
        max_requests = len(workload) if workload else FALLBACK_MAX_REQUESTS
        logits_bytes = 2 * 4 * shape.vocab_size  # fp32 logits plus their processed copy
        max_requests = max(1, min(max_requests, max_batch_tokens, batch_budget // logits_bytes))

    page_size = config.page_size
    num_pages = config.num_blocks
    cache_budget = budget - batch_budget
    if device.type == "cpu":
        cache_budget = min(cache_budget, CPU_CACHE_CAP_BYTES)
    num_slots = 0
    if state_bytes_per_slot:
        # One slot per request that may run at once, taking at most half of the cache's budget: the
        # pages get the rest (a request holds one slot and its pages).
        affordable = (cache_budget // 2) // state_bytes_per_slot
        num_slots = max(1, min(max_requests, affordable))
        cache_budget -= num_slots * state_bytes_per_slot
    if num_pages is None:
        token_bytes = kv_token_bytes(shape, config, element_size) + extra_kv_bytes_per_token
        num_pages = cache_budget // max(1, token_bytes * page_size)
        if workload:
            needed = sum(num_pages_for(n, page_size) for n in workload)
            # Headroom for the safety margin: without it the last requests of the workload
            # would wait for the first ones to finish although the job fits.
            margin = min(config.resolved_safety_margin, 0.5)
            wanted = -(-needed // (1 - margin)) if margin > 0 else needed
            num_pages = min(num_pages, int(wanted)) if device.type == "cpu" else num_pages
            # Make room for the largest request when memory allows it.
            num_pages = max(num_pages, max(num_pages_for(n, page_size) for n in workload))
        num_pages = max(1, int(num_pages))

    max_pages_per_request = min(num_pages, num_pages_for(shape.max_position_embeddings, page_size))
    return Sizing(
        num_pages=num_pages,
        page_size=page_size,
        max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=max_requests,
        max_pages_per_request=max_pages_per_request,
        num_state_slots=num_slots,
    )


def kv_token_bytes(shape: ModelShape, config: ContinuousBatchingConfig, element_size: int) -> int:
    """One token's KV bytes in the cache `config` asks for: the model's dtype (`element_size`), or int8 values
    with their float32 scales (`kv_cache_dtype="int8"`)."""
    if config.kv_cache_dtype == INT8:
        return shape.kv_bytes_per_token(1, SCALE_BYTES)
    return shape.kv_bytes_per_token(element_size)


def max_pages_held(spec: KVGroupSpec, num_tokens: int, page_size: int, max_batch_tokens: int) -> int:
    """The most pages a request of `num_tokens` KV tokens holds at once in group `spec`."""
    full = num_pages_for(num_tokens, page_size)
    if spec.span is None:
        return full
    # Its window (or attention chunk) plus the chunk a step writes, straddling one more page at most.
    return min(full, num_pages_for(spec.span - 1 + max_batch_tokens, page_size) + 1)


def resolve_group_pages(
    sizing: Sizing,
    groups: list[KVGroupSpec],
    config: ContinuousBatchingConfig,
    workload: list[int] | None = None,
) -> tuple[list[int], list[int]]:
    """Pages of each KV group and the block-table width of each group.

    Full-attention groups get `sizing.num_pages`. A sliding (or chunked) group never needs more than
    its windows (chunks): with the workload known it gets what the workload holds at most (with the safety
    margin's headroom), else as many as a full group. `num_blocks` set by the user applies to
    every group.
    """
    page_size, chunk = sizing.page_size, sizing.max_batch_tokens
    pages, widths = [], []
    for spec in groups:
        num_pages = sizing.num_pages
        if spec.span is not None and config.num_blocks is None and workload:
            held = [max_pages_held(spec, n, page_size, chunk) for n in workload]
            margin = min(config.resolved_safety_margin, 0.5)
            needed = -(-sum(held) // (1 - margin)) if margin > 0 else sum(held)
            num_pages = max(1, min(num_pages, max(int(needed), max(held))))
        width = min(num_pages, sizing.max_pages_per_request)
        if spec.span is not None:
            # The row is a ring: it only has to span the pages held at once.
            width = min(width, num_pages_for(spec.span - 1 + chunk, page_size) + 1)
        pages.append(num_pages)
        widths.append(width)
    return pages, widths
