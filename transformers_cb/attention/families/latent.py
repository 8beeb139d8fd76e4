"""Multi-latent attention over a latent group's pages (DeepSeek V2/V3, MiniCPM3, Kimi, GLM-4 MoE-lite, ...).

transformers' MLA modules (`DeepseekV3Attention` and its copies in every family) compute their query, the
compressed KV (`kv_a_layernorm` of `kv_a_proj_with_mqa`'s first `kv_lora_rank` values) and the rotary key
themselves, then decompress both through `expand_kv` (`kv_b_proj`) before calling the attention interface,
so the interface never sees the latent. For the run (`latent_pass_through`, entered with the paged backend
by attention/selection.py), each such module's `expand_kv` hands the latent through unchanged: the paged
forward (attention/paged.py) then receives the query, the latent `[1, 1, T, kv_lora_rank]` as its key and
the rotary key `[1, 1, T, qk_rope_head_dim]` as its value, and routes a latent group's layer here:

- `[latent, rotary key]` is written into the layer's latent pages: one row per token, nothing
  decompressed (the group's value cache is its key cache: memory/kv_cache.py);
- a prefill chunk decompresses every cached latent of its request with the module's own `expand_kv` and
  attends as the model does;
- a decode (and every token the native kernel attends) absorbs `W_UK` into the query (`q_nope @ W_UK`),
  attends over the latent rows as one KV head (an MQA whose values are the rows themselves, of which the
  latent part is kept) and applies `W_UV` after it. That reorders the sums: equal to the decompressed
  attention up to rounding, not bitwise.

The module's projections, norms, rotary embedding and output projection stay its own; only the
attention over the cache is ours. Every family's `expand_kv` is the same code (`kv_b_proj` split per head
into `qk_nope_head_dim` key and `v_head_dim` value rows); `latent_module_problem` checks it numerically
before a run, so a family that decompresses another way is refused, not run wrong.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from ...invariants import present
from ...patches import patched
from ..metadata import STEP_METADATA, AttentionMetadata
from ..mixed_paged import gather_slots
from ..native.kernel import native_paged_attention
from .sparse_index import segments, selected_mask

PATCH_KIND = "latent_pass_through"  # its counted patches (patches.py)

# What an MLA module must have for the absorbed attention (the same names in every family).
LATENT_ATTRIBUTES = ("num_heads", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")

# The MLA modules of each model (found once: the session installs and removes their pass-through per run).
_modules: weakref.WeakKeyDictionary[torch.nn.Module, list[torch.nn.Module]] = weakref.WeakKeyDictionary()


def is_latent_module(module: torch.nn.Module) -> bool:
    """An attention module that decompresses a latent KV (`kv_b_proj`, `expand_kv`) before attending."""
    return (
        hasattr(module, "kv_b_proj")
        and callable(getattr(type(module), "expand_kv", None))
        and getattr(module, "kv_lora_rank", None) is not None
    )


def latent_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's MLA attention modules, in module order."""
    found = _modules.get(model)
    if found is None:
        found = [m for m in model.modules() if is_latent_module(m)]
        _modules[model] = found
    return found


class HandedThrough:
    """An MLA module's `expand_kv` for a run: inside a continuous-batching forward (the runner's
    `STEP_METADATA` is an `AttentionMetadata` in this thread) it returns the latent and the rotary key
    unchanged, for the paged forward; anywhere else (a plain `generate()` during the run, the support
    check's probe) it decompresses as the module's class does."""

    def __init__(self, module: Any) -> None:
        self.module = module

    def __call__(self, kv_nope: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(STEP_METADATA.get(), AttentionMetadata):
            return kv_nope, k_rot
        return type(self.module).expand_kv(self.module, kv_nope, k_rot)


@contextmanager
def latent_pass_through(model: torch.nn.Module) -> Iterator[None]:
    """Inside: every MLA module of `model` hands its latent and rotary key to the paged forward
    undecompressed (an instance `expand_kv`, `HandedThrough`: a counted patch, patches.py, shared by
    overlapping runs and removed by the last)."""
    with patched(PATCH_KIND, [(m, "expand_kv", partial(HandedThrough, m)) for m in latent_modules(model)]):
        yield


def absorbed_weights(module: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """`W_UK` `[H, qk_nope_head_dim, kv_lora_rank]` and `W_UV` `[H, v_head_dim, kv_lora_rank]`: `kv_b_proj`'s
    weight split per head as `expand_kv` splits its output (views, no copy)."""
    heads, nope, value = module.num_heads, module.qk_nope_head_dim, module.v_head_dim
    weight = module.kv_b_proj.weight.view(heads, nope + value, module.kv_lora_rank)
    return weight[:, :nope], weight[:, nope:]


def latent_module_problem(module: Any) -> str | None:
    """Why `module`'s latent cannot be attended here (None: it can): a missing attribute, a biased
    `kv_b_proj`, or an `expand_kv` that decompresses otherwise than `absorbed_weights` splits it."""
    missing = [name for name in LATENT_ATTRIBUTES if not isinstance(getattr(module, name, None), int)]
    if missing:
        return f"{type(module).__name__} has no {missing}"
    projection = module.kv_b_proj
    if not isinstance(projection, torch.nn.Linear) or projection.bias is not None:
        return f"{type(module).__name__}.kv_b_proj is not a Linear without bias"
    weight = projection.weight
    if weight.device.type == "meta":
        return None
    generator = torch.Generator(device="cpu").manual_seed(0)
    latent = torch.randn(1, 1, 3, module.kv_lora_rank, generator=generator).to(weight)
    rope = torch.randn(1, 1, 3, module.qk_rope_head_dim, generator=generator).to(weight)
    try:
        with torch.no_grad():
            key, value = type(module).expand_kv(module, latent, rope)
            w_uk, w_uv = absorbed_weights(module)
            heads = module.num_heads
            c, r = latent[0, 0].float(), rope[0].float()
            expected_key = torch.cat(
                (torch.einsum("lr,hnr->hln", c, w_uk.float()), r.expand(heads, -1, -1)), dim=-1
            )
            expected_value = torch.einsum("lr,hvr->hlv", c, w_uv.float())
    except (RuntimeError, TypeError, ValueError) as error:  # e.g. a quantized kv_b_proj's weight
        return f"{type(module).__name__}.kv_b_proj's weight cannot be read per head ({type(error).__name__}: {error})"
    # Why relative to the largest value, and loose in 16 bits: rounding, not a layout, must pass; another
    # split or order of the rows is off by the values' own size.
    tolerance = 1e-3 if weight.dtype in (torch.float32, torch.float64) else 5e-2
    if not (_close(key, expected_key, tolerance) and _close(value, expected_value, tolerance)):
        return (
            f"{type(module).__name__}.expand_kv decompresses its latent otherwise than kv_b_proj split per head "
            "into qk_nope_head_dim key and v_head_dim value rows, the one layout the absorbed attention reads"
        )
    return None


def _close(actual: torch.Tensor, expected: torch.Tensor, tolerance: float) -> bool:
    """`actual` `[1, *expected.shape]` within `tolerance` of `expected`, relative to its largest value."""
    if actual.shape != (1, *expected.shape):
        return False
    scale = max(float(expected.abs().max()), 1e-6)
    return float((actual[0].float() - expected).abs().max()) <= tolerance * scale


def _absorbed_query(query: torch.Tensor, w_uk: torch.Tensor, nope: int) -> torch.Tensor:
    """`[T, H, nope + rope]` -> `[T, H, kv_lora_rank + rope]`: the no-rope part taken into the latent space."""
    latent = torch.einsum("thn,hnr->thr", query[..., :nope], w_uk.to(query.dtype))
    return torch.cat((latent, query[..., nope:]), dim=-1)


def _values(latent_out: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """`[T, H, kv_lora_rank]` attended latents -> `[T, H, v_head_dim]` values (`W_UV` after the attention)."""
    return torch.einsum("thr,hvr->thv", latent_out, w_uv.to(latent_out.dtype))


def _decompressed(module: Any, rows: torch.Tensor, rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Latent rows `[L, 1, rank + rope]` as the module's own K `[1, H, L, nope + rope]` and V `[1, H, L, v]`."""
    rows = rows.to(dtype)[:, 0]
    return type(module).expand_kv(module, rows[None, None, :, :rank], rows[None, None, :, rank:])


def _with_sinks(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """Attention `[1, H, Q, v]` whose softmax each head's sink logit joins without a value (GPT-OSS style)."""
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale  # [1, H, Q, L]
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.cat((scores, sink), dim=-1).softmax(dim=-1, dtype=torch.float32)[..., :-1]
    return torch.matmul(probs.to(value.dtype), value)


def _selected_attention(
    module: Any,
    q: torch.Tensor,
    key_cache: torch.Tensor,
    rank: int,
    indices: torch.Tensor,
    metadata: AttentionMetadata,
    layer_idx: int,
    scale: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """DeepSeek sparse attention: every request's queries over its decompressed keys, masked to the causal
    keys its indexer selected (as `generate()` masks its eager / SDPA attention), with the layer's sinks.
    Returns `[1, T, H, v]`."""
    out = q.new_empty(q.shape[0], q.shape[1], module.v_head_dim)
    for segment in segments(metadata, metadata.group_of(layer_idx)):
        rows = slice(segment.start, segment.end)
        key, value = _decompressed(module, gather_slots(key_cache, segment.key_slots), rank, q.dtype)
        mask = selected_mask(indices, rows, segment.first, segment.key_slots.shape[0])
        query = q[rows].transpose(0, 1).unsqueeze(0)
        if sinks is None:
            o = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)
        else:
            o = _with_sinks(query, key, value, mask, scale, sinks)
        out[rows] = o[0].transpose(0, 1)
    return out.unsqueeze(0)


@torch.compiler.disable
def latent_attention(
    module: Any,
    query: torch.Tensor,
    latent: torch.Tensor,
    rope_key: torch.Tensor,
    layer_idx: int,
    metadata: AttentionMetadata,
    scale: float,
    indices: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One MLA layer of a packed step over its latent pages.

    Args: query `[1, H, T, qk_nope_head_dim + qk_rope_head_dim]`, latent `[1, 1, T, kv_lora_rank]`, rope_key
    `[1, 1, T, qk_rope_head_dim]` (what the module passes with its `expand_kv` handed through); indices: a
    DeepSeek sparse attention layer's selected keys `[1, T, index_topk]` (positions, -1: none;
    attention/families/sparse_index.py), each query then attending its request's decompressed keys it selected;
    sinks: such a layer's attention-sink logits `[H]` (HY-V4).
    Returns `[1, T, H, v_head_dim]`, the layout transformers' attention functions return."""
    cache = metadata.cache
    group = metadata.group_of(layer_idx)
    rank, rope = group.latent or (0, 0)
    if latent.dim() != 4 or latent.shape[1] != 1 or latent.shape[-1] != rank or rope_key.shape[-1] != rope:
        raise ValueError(
            f"layer {layer_idx} caches a latent of {rank} + {rope} values per token, but its attention was "
            f"given K {tuple(latent.shape)} and V {tuple(rope_key.shape)} (decompressed K/V: the module's "
            "expand_kv is not handed through, which the paged backend's session does)"
        )
    rows = torch.cat((latent, rope_key), dim=-1)[0].transpose(0, 1)  # [T, 1, rank + rope]
    key_cache, _ = cache.layer(layer_idx)
    key_cache.index_copy_(0, group.slot_mapping, rows.to(key_cache.dtype))
    q = query[0].transpose(0, 1)  # [T, H, nope + rope]
    if group.latent is not None and metadata.cache.key_dim(metadata.cache.layer_group[layer_idx]) is not None:
        if indices is None:
            raise ValueError(
                f"layer {layer_idx} caches an indexer's keys but its attention was given no selected keys "
                "(`indices`: the indexer is not handed through, which the paged backend's session does)"
            )
        return _selected_attention(module, q, key_cache, rank, indices, metadata, layer_idx, scale, sinks)
    w_uk, w_uv = absorbed_weights(module)
    nope = module.qk_nope_head_dim
    out = q.new_empty(q.shape[0], q.shape[1], module.v_head_dim)
    # Only the tokens attended over the latent need the absorbed query: the native run and the decodes,
    # which lead the packed step (a prefill chunk after them decompresses).
    absorbed_rows = max([metadata.native_tokens, *(decode.q_end for decode in group.decode_groups)])
    absorbed = _absorbed_query(q[:absorbed_rows], w_uk, nope)
    if metadata.native_tokens:
        n = metadata.native_tokens
        attended = key_cache.new_empty(n, q.shape[1], rank + rope)
        native_paged_attention(
            absorbed[:n].to(key_cache.dtype).contiguous(),
            key_cache,
            key_cache,  # the values are the latent rows; their rotary tail is dropped below
            present(metadata.token_row, "native tokens without their rows"),
            present(metadata.token_pos, "native tokens without their positions"),
            group.block_table,
            cache.page_size,
            scale,
            group.kernel_window,
            None,
            None,
            attended,
        )
        out[:n] = _values(attended[..., :rank].to(q.dtype), w_uv)
    for decode in group.decode_groups:
        q_group = absorbed[decode.q_start : decode.q_end].unsqueeze(2)  # [B, H, 1, rank + rope]
        k_group = gather_slots(key_cache, decode.kv_slots).transpose(1, 2).to(q.dtype)  # [B, 1, L, D]
        o = F.scaled_dot_product_attention(
            q_group, k_group, k_group[..., :rank], attn_mask=decode.kv_mask, scale=scale, enable_gqa=True
        )  # [B, H, 1, rank]
        out[decode.q_start : decode.q_end] = _values(o.squeeze(2), w_uv)
    for chunk in group.prefill_groups:
        span = slice(chunk.q_start, chunk.q_end)
        q_group = q[span].transpose(0, 1).unsqueeze(0)  # [1, H, Q, nope + rope]
        cached = rows[span] if chunk.kv_slots is None else gather_slots(key_cache, chunk.kv_slots)
        key, value = _decompressed(module, cached, rank, q.dtype)  # [1, H, L, *]
        is_causal = chunk.kv_slots is None and chunk.q_end - chunk.q_start > 1 and chunk.mask is None
        o = F.scaled_dot_product_attention(
            q_group, key, value, attn_mask=chunk.mask, is_causal=is_causal, scale=scale
        )
        out[span] = o[0].transpose(0, 1)
    return out.unsqueeze(0)
