"""The attention probe's recording attention function: each call a layer makes through transformers'
attention interface, recorded as one `AttentionCall` (shapes, layout, window, causality, mask bias or
window, ALiBi, a K/V tiling) into the `ProbeRecord` of the probe running in this thread, while the forward
goes on with plain causal attention over real values.

Apart from model_check/attention_probe.py, which runs the forwards and reads the record into the contract's
broken clauses: this is what one call looks like, that is what the calls mean.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from transformers import PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface

from ..attention.backends.eager import eager_attend
from ..attention.families.alibi import RELATIVE
from ..attention.families.classic import classic_attention, has_classic_attention
from ..attention.paged import ALIBI_FORM_KWARG, ALIBI_KWARG

PROBE_NAME = "cb_dispatch_probe"
# Five tokens: a count no head count or head size is likely to equal, so a model that swaps the token and
# head axes (BART's decoder given position_ids builds 5D states) cannot look right by accident.
PROBE_TOKENS = 5

# Kwargs the paged forwards refuse (`attention/paged.py: unsupported_kwargs`).
UNSUPPORTED_KWARGS = ("sinks", "attention_chunk_size")

_register_lock = threading.Lock()


@dataclass
class AttentionCall:
    layer_idx: int | None
    key_shape: tuple[int, int]  # (KV heads, head dim)
    value_shape: tuple[int, int]
    query_heads: int
    layout_ok: bool  # query/key/value are [1, heads, PROBE_TOKENS, head_dim]
    sliding_window: int | None
    causal: bool
    mask_bias: bool  # the mask carries finite nonzero values: an attention bias (ALiBi), not just masking
    unsupported: tuple[str, ...]
    mask_windowed: bool = False  # the mask hides some earlier key from some query (a window)
    alibi: bool = False  # ALiBi slopes passed: positions are the keys' (attention/families/alibi.py)
    kv_repeat: int = 1  # K and V are their first key_shape[0] // kv_repeat heads tiled this many times


@dataclass
class ProbeRecord:
    calls: list[AttentionCall] = field(default_factory=list)  # forward A's (the engine's call)
    plain_calls: list[AttentionCall] = field(default_factory=list)  # forward B's (generate()'s call)
    window_calls: list[AttentionCall] = field(default_factory=list)  # forward C's (B under a shrunk window)
    in_plain: bool = False
    in_window: bool = False


# The record of the probe running in this thread (its attention function is global to transformers).
ACTIVE_RECORD: contextvars.ContextVar[ProbeRecord | None] = contextvars.ContextVar(
    "cb_dispatch_probe", default=None
)


def recording_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The probe's attention function: records the call, returns plain causal attention over `key`/`value`."""
    record = ACTIVE_RECORD.get()
    if record is not None:
        target = (
            record.window_calls
            if record.in_window
            else record.plain_calls
            if record.in_plain
            else record.calls
        )
        target.append(
            AttentionCall(
                layer_idx=getattr(module, "layer_idx", None),
                key_shape=(key.shape[1], key.shape[-1]),
                value_shape=(value.shape[1], value.shape[-1]),
                query_heads=query.shape[1],
                layout_ok=all(
                    t.dim() == 4 and t.shape[0] == 1 and t.shape[2] == PROBE_TOKENS
                    for t in (query, key, value)
                ),
                sliding_window=kwargs.get("sliding_window"),
                causal=kwargs.get("is_causal", getattr(module, "is_causal", True)) is not False,
                mask_bias=is_bias(attention_mask),
                unsupported=tuple(n for n in UNSUPPORTED_KWARGS if kwargs.get(n) is not None),
                mask_windowed=is_windowed(attention_mask),
                alibi=kwargs.get(ALIBI_KWARG) is not None,
                kv_repeat=kv_tiling(key, value),
            )
        )
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return query.new_zeros(*query.shape[:-3], query.shape[-2], query.shape[-3], value.shape[-1]), None
    batch, heads, q_len, _ = query.shape
    if heads % key.shape[1] or key.shape[-1] != query.shape[-1]:
        # A shape the paged kernels cannot run anyway (recorded above): keep the forward going.
        return query.new_zeros(batch, q_len, heads, value.shape[-1]), None
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = eager_attend(
        query,
        key,
        value,
        None,
        True,
        scale,
        kwargs.get("softcap"),
        kwargs.get("s_aux"),
        kwargs.get(ALIBI_KWARG),
        kwargs.get(ALIBI_FORM_KWARG) or RELATIVE,
    )
    return out.transpose(1, 2).contiguous(), None  # [B, T, H, D], as transformers' functions return


def kv_tiling(key: torch.Tensor, value: torch.Tensor) -> int:
    """How many times `key` and `value` `[B, Hkv, T, D]` repeat their first heads along the head axis
    (`x.repeat(1, n, 1, 1)`: JetMoE, once per routed expert), bitwise; 1 when they do not."""
    if key.dim() != 4 or value.dim() != 4 or key.shape[1] != value.shape[1]:
        return 1
    heads = key.shape[1]
    for period in range(1, heads):
        if heads % period == 0 and all(
            torch.equal(t, t[:, :period].repeat(1, heads // period, 1, 1)) for t in (key, value)
        ):
            return heads // period
    return 1


def is_bias(mask: torch.Tensor | None) -> bool:
    """A float mask whose kept entries are not all 0: it adds a bias to the logits (the paged kernels
    mask by construction and add nothing)."""
    if mask is None or not torch.is_floating_point(mask):
        return False
    kept = mask[mask > torch.finfo(mask.dtype).min / 2]
    return bool((kept != 0).any())


def is_windowed(mask: torch.Tensor | None) -> bool:
    """A mask that hides some key at or before its query (a window: causal masking hides only later keys)."""
    if not isinstance(mask, torch.Tensor) or mask.dim() < 2 or mask.shape[-1] != mask.shape[-2]:
        return False
    earlier = torch.ones(mask.shape[-2:], dtype=torch.bool, device=mask.device).tril()
    hidden = ~mask if mask.dtype == torch.bool else mask < torch.finfo(mask.dtype).min / 2
    return bool((hidden & earlier).any())


def _register_probe() -> None:
    with _register_lock:
        if AttentionInterface._global_mapping.get(PROBE_NAME) is not recording_attention:
            AttentionInterface.register(PROBE_NAME, cast(Callable[..., Any], recording_attention))
            AttentionMaskInterface.register(
                PROBE_NAME, cast(Callable[..., Any], AttentionMaskInterface._global_mapping["sdpa"])
            )


@contextmanager
def recording(model: PreTrainedModel):
    """The model on the recording attention, in eval mode (dropout would make A and B differ)."""
    _register_probe()
    saved_impl, was_training = model.config._attn_implementation, model.training
    switch = not has_classic_attention(model)  # their classes cannot switch (attention/families/classic.py)
    if switch:
        model.set_attn_implementation(PROBE_NAME)
    model.eval()
    try:
        with classic_attention(model, recording_attention):  # the classic families, as the run adapts them
            yield
    finally:
        if switch:
            model.set_attn_implementation(saved_impl if saved_impl is not None else "sdpa")
        model.train(was_training)
