"""Glue shared by the paged backends: write the step's new K/V, then attend group by group.

A backend only supplies `attend(q, k, v, mask, is_causal, scale, softcap, sinks, slopes)`
over dense per-group tensors; the paging (slot writes and gathers) lives here once.

Per layer, the kernels apply exactly what the model's attention module asks for
through its kwargs: its `scaling`, its `sliding_window` (which must match the KV
group the layer's pages come from: the window is applied by the gathers and
masks built for that group), its logit `softcap`, its attention sinks
(`s_aux`, GPT-OSS), and its ALiBi slopes (`alibi_slopes`, passed by the classic families'
adapters: attention/families/classic.py; the kernels add the bias from positions: attention/families/alibi.py).
Nothing is assumed to be the same across layers. A chunked layer (Llama 4) passes no kwarg for its chunk: its group's gathers and masks apply
the config's `attention_chunk_size`, the one rule transformers' chunked mask applies. A layer of a latent
group (multi-latent attention) is handed to attention/families/latent.py whatever the backend.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import cast

import torch

from ..invariants import present
from ..memory.kv_cache import layer_views, scale_views
from .families.alibi import RELATIVE, AlibiForm
from .families.latent import latent_attention
from .families.repeated_kv import retiled, untiled
from .families.temperature import retuned_query, tunes_temperature
from .metadata import STEP_METADATA, AttentionMetadata
from .mixed_paged import Attend, mixed_paged_attention
from .native.kernel import native_paged_attention, write_pages

METADATA_KWARG = "cb_attention_metadata"
NATIVE_STEPS_MARK = "runs_native_steps"
# The `[H]` ALiBi slopes of a layer, passed by the classic families' adapters (attention/families/classic.py).
ALIBI_KWARG = "alibi_slopes"
# Its form when not the relative float32 one (`AlibiForm`: Falcon's), passed beside the slopes.
ALIBI_FORM_KWARG = "alibi_form"

# The metadata of the step whose forward is running in this thread (None outside one) is `STEP_METADATA`
# (attention/metadata.py). Why: some decoder layers (StableLM, Nemotron) call their attention module
# without the forward's `**kwargs`, so the metadata kwarg never reaches the attention function; the
# runner sets it for the forward's duration and the glue reads it when the kwarg is missing.


@contextmanager
def step_metadata(metadata: AttentionMetadata) -> Iterator[None]:
    """Inside: `current_step_metadata()` is `metadata` in this thread (the forward of one step)."""
    token = STEP_METADATA.set(metadata)
    try:
        yield
    finally:
        STEP_METADATA.reset(token)


def current_step_metadata() -> AttentionMetadata | None:
    """The metadata of the step running in this thread, or None outside a continuous-batching forward."""
    return STEP_METADATA.get()


def native_layer_attention(
    query: torch.Tensor,
    new_keys: torch.Tensor,
    new_values: torch.Tensor,
    kv_storage: torch.Tensor,
    layer: int,
    slot_mapping: torch.Tensor,
    token_row: torch.Tensor,
    token_pos: torch.Tensor,
    block_table: torch.Tensor,
    page_size: int,
    scale: float,
    window: int,
    softcap: float,
    sinks: torch.Tensor | None,
    slopes: torch.Tensor | None = None,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """One layer of a step whose every token the native kernel attends, as one opaque torch op: write the
    step's new K/V `[T, Hkv, D]` at `slot_mapping`, then attend `query` `[T, H, D]` from the pages.

    `kv_storage` is the KV group's whole tensor (`PagedKVCache.group_tensors`) and `layer` the layer's
    index inside it: the op mutates that one tensor, so the compiled graph never sees two mutated inputs
    that alias each other (per-layer views of one buffer). `window` / `softcap` 0: off; a negative
    `window` is an attention chunk (`GroupMetadata.kernel_window`); `slopes` `[H]`: ALiBi (None: off);
    `kv_scales`: an int8 cache's scale tensor of the group (`PagedKVCache.scale_tensors`): the new K/V are
    quantized into the pages, their scales written there, and the kernel reads both.
    Returns `[T, H, D]`.
    """
    key_cache, value_cache = layer_views(kv_storage, layer)
    scales = None if kv_scales is None else scale_views(kv_scales, layer)
    write_pages(key_cache, value_cache, slot_mapping, new_keys, new_values, scales)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    native_paged_attention(
        query.contiguous(),
        key_cache,
        value_cache,
        token_row,
        token_pos,
        block_table,
        page_size,
        scale,
        window,
        softcap or None,
        sinks,
        out,
        slopes,
        scales,
    )
    return out


# The same as one opaque torch op, for a compiled forward (inductor places it, no graph break). An eager forward
# calls the function itself: the custom op's dispatch (schema defaults, the mutation's bookkeeping) costs
# ~95 us of CPU a call here, against ~3 us for the call, per layer and step (30 layers: ~2.9 ms a step).
native_paged_attention_op = torch.library.custom_op(
    "transformers_cb::native_paged_attention",
    native_layer_attention,
    mutates_args=("kv_storage", "kv_scales"),
)


@native_paged_attention_op.register_fake
def _native_paged_attention_fake(query, new_keys, new_values, kv_storage, layer, *args) -> torch.Tensor:
    return torch.empty(query.shape, dtype=query.dtype, device=query.device)


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer_idx: int,
    metadata: AttentionMetadata,
    scale: float,
    attend: Attend,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    slopes: torch.Tensor | None = None,
    alibi_form: AlibiForm = RELATIVE,
) -> torch.Tensor:
    """Args: query `[1, H, T, D]`, key/value `[1, Hkv, T, D]` of the packed step; softcap: logit
    softcapping of this layer; sinks: `[H]` attention-sink logits of this layer; slopes: `[H]` ALiBi slopes;
    alibi_form: how they are added (a form the native kernel does not add runs its tokens through `attend`).

    Returns `[1, T, H, D]`, the layout transformers' attention functions return.

    A step whose every token the native kernel attends (decodes and short prefill chunks) is one custom op
    per layer, which `torch.compile` keeps in its graph (no break); any other step runs
    `mixed_paged_attention` (attention/mixed_paged.py), whose Python follows the step's groups (the runner runs such steps' forward
    eagerly: see runner/forward/compiling.py).
    """
    if (
        not metadata.all_native
        or (slopes is not None and not alibi_form.native)
        or metadata.cache.key_dim(metadata.cache.layer_group[layer_idx]) is not None
    ):
        # A form of ALiBi the native kernel does not add, or a V head size other than K's (the kernel reads
        # V with K's size): the torch paths run them.
        return mixed_paged_attention(
            query, key, value, layer_idx, metadata, scale, attend, softcap, sinks, slopes, alibi_form
        )
    group_metadata = metadata.group_of(layer_idx)
    storage, layer = metadata.cache.storage_of(layer_idx)
    run = native_paged_attention_op if torch.compiler.is_compiling() else native_layer_attention
    out = run(
        query[0].transpose(0, 1),  # [T, H, D]
        key[0].transpose(0, 1),  # [T, Hkv, D]
        value[0].transpose(0, 1),
        storage,
        layer,
        group_metadata.slot_mapping,
        present(metadata.token_row, "an all-native step without token rows"),
        present(metadata.token_pos, "an all-native step without token positions"),
        group_metadata.block_table,
        metadata.cache.page_size,
        scale,
        group_metadata.kernel_window,
        softcap or 0.0,
        sinks,
        slopes,
        metadata.cache.scales_of(layer_idx),
    )
    return out.unsqueeze(0)


# A paged kernel as the forwards below call it: (query, key, value, layer_idx, metadata, scale, softcap, sinks),
# and `slopes=` for an ALiBi layer (a kernel without ALiBi refuses it: `ALIBI_KWARG`).
PagedRun = Callable[..., torch.Tensor]


def make_paged_forward(
    attend: Attend, fallback: Callable, name: str, plain_fallback: Callable | None = None
) -> Callable:
    """The function registered in transformers' `AttentionInterface` for one paged backend.

    Inside continuous batching (metadata in the kwargs) it runs `paged_attention` with `attend`;
    otherwise (e.g. plain `generate()` on a paged model) it behaves like `fallback`, or like
    `plain_fallback` for layers `fallback` cannot run (softcapping, sinks).
    """

    def run(
        query, key, value, layer_idx, metadata, scale, softcap, sinks, slopes=None, alibi_form=RELATIVE
    ) -> torch.Tensor:
        return paged_attention(
            query, key, value, layer_idx, metadata, scale, attend, softcap, sinks, slopes, alibi_form
        )

    forward = make_forward(run, fallback, name, plain_fallback)
    # An all-native step runs `native_layer_attention` whatever `attend` is: a decoder layer that calls it
    # itself (runner/layer_ops/direct_layer.py) looks for this mark on the model's attention function.
    forward.__dict__[NATIVE_STEPS_MARK] = True
    return forward


def make_forward(
    run: PagedRun, fallback: Callable, name: str, plain_fallback: Callable | None = None
) -> Callable:
    """An `AttentionInterface` function: `run` inside continuous batching, the fallbacks outside it
    (see `make_paged_forward`). Shared by the paged torch backends and the flash ones."""

    def forward(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        metadata = kwargs.pop(METADATA_KWARG, None)
        if metadata is None:
            # A layer that dropped the kwargs on the way down: the step's metadata from the runner.
            metadata = current_step_metadata()
        if metadata is None:
            needs_plain = kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None
            plain = plain_fallback if needs_plain and plain_fallback is not None else fallback
            return plain(
                module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
            )
        sliding_window = kwargs.pop("sliding_window", None)
        # DeepSeek sparse attention's selected keys (attention/families/sparse_index.py); None for any other layer.
        indices = kwargs.pop("indices", None)
        softcap = kwargs.pop("softcap", None)
        sinks = kwargs.pop("s_aux", None)
        slopes = kwargs.pop(ALIBI_KWARG, None)
        alibi_form = kwargs.pop(ALIBI_FORM_KWARG, None) or RELATIVE
        unsupported_kwargs(kwargs)
        layer_idx = cast(int, module.layer_idx)  # transformers' attention modules know their layer
        group_metadata = metadata.group_of(layer_idx)
        check_window(layer_idx, sliding_window, group_metadata.sliding_window)
        if slopes is not None:
            alibi_form.check_layer(f"layer {layer_idx}", group_metadata.sliding_window)
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            out = run(
                query,
                key,
                value,
                layer_idx,
                metadata,
                scale,
                softcap,
                sinks,
                slopes=slopes,
                alibi_form=alibi_form,
            )
            return out, None
        if group_metadata.latent is not None:
            # A multi-latent layer: `key` is its latent, `value` its rotary key (attention/families/latent.py).
            if softcap is not None or (sinks is not None and indices is None):
                raise NotImplementedError(
                    f"layer {layer_idx}: multi-latent attention with softcap / sinks is not implemented "
                    "(sinks are, on DeepSeek sparse attention layers)"
                )
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            return latent_attention(
                module, query, key, value, layer_idx, metadata, scale, indices, sinks
            ), None
        if indices is not None:
            raise NotImplementedError(f"layer {layer_idx}: selected keys (indices) outside a latent layer")
        if tunes_temperature(module):
            # Llama 4's NoPE layers scale their queries by a position they number by step index.
            if metadata.position_ids is None:
                raise ValueError(
                    f"layer {layer_idx} tunes its attention temperature by position, and this step "
                    "carries no positions"
                )
            query = retuned_query(module, query, metadata.position_ids)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        spec = metadata.kv_group_of(layer_idx)
        if spec.kv_repeat > 1:
            # K/V the layer tiled over its query heads (JetMoE): cached once (attention/families/repeated_kv.py).
            heads = present(spec.head_shape, "a repeated K/V group without its head shape")[0]
            query, key, value, order = untiled(query, key, value, heads, spec.kv_repeat)
            sinks = None if sinks is None else sinks.index_select(0, order)
            out = run(query, key, value, layer_idx, metadata, scale, softcap, sinks)
            return retiled(out, order), None
        return run(query, key, value, layer_idx, metadata, scale, softcap, sinks), None

    forward.__name__ = forward.__qualname__ = name
    return forward


def check_window(layer_idx: int, requested: int | None, cached: int | None) -> None:
    """The layer's own window must be the one its KV group keeps pages for (else the config was misread)."""
    if requested != cached:
        raise ValueError(
            f"layer {layer_idx} applies sliding_window={requested!r} but its KV cache group was built for "
            f"sliding_window={cached!r} from the model config; continuous batching cannot run this model"
        )


def unsupported_kwargs(kwargs: dict) -> None:
    """Refuse attention variants this backend does not implement, instead of ignoring them."""
    for name in ("sinks", "attention_chunk_size"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"paged attention with {name}={kwargs[name]!r} is not implemented yet")
