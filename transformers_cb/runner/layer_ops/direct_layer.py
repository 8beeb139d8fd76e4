"""A Llama-form decoder layer's step as one native call: the same ops as its modules' forwards, without the
calls between them.

A decode step's layer on a small model is mostly calls: its ~13 module calls, the attention interface's
keyword handling, the fused product's hand-over between siblings, the checks each replaced forward repeats
and ~40 small torch calls at 2-5 us each here (a 30-layer width-192 model: 15-20 ms a step). `direct_step`
decides in Python what each part of the layer's forwards would do for this call (each projection's product
as its forward would pick it: `ProductSpecs`) and runs the whole layer in `decoder_layer`
(attention/native/native_decoder_source.py), which makes the same calls in the same order from C++. So
outputs are the same bits either way (tests/runner/test_direct_layer.py): only calls are saved. Where any
part would take another path it returns None and the modules' own forwards run; a native call that raises
falls back once, with a warning.

It applies to a layer whose forward, attention, MLP and both norms are replaced by the native layer ops
(runner/layer_ops/native_layers.py: their forms recognised by code, Llama's attention among them), whose
modeling file's rotary is the native one, whose projections are plain `nn.Linear`s (packed or not) of plain
CPU tensors, or a GGUF model's `QuantizedLinear`s on the rows their forward gives `quant_matmul`, with no
hooks anywhere on the way (nor global ones), on an all-native step (attention/paged.py)
of a paged backend whose layer has no window, ALiBi, latent, repeated K/V or int8 cache, outside autograd
and compile. `TRANSFORMERS_CB_DIRECT_LAYERS=0` turns it off.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch.nn.modules import module as nn_module

from ...attention.families.temperature import tunes_temperature
from ...attention.metadata import AttentionMetadata
from ...attention.paged import METADATA_KWARG, current_step_metadata
from .layer_plan import LayerParts, plain_cpu, plan_for

logger = logging.getLogger(__name__)

# Set by the first native call that raised: the modules' forwards run from then on in this process.
_failed: list[str] = []


def _fail(error: RuntimeError) -> None:
    if not _failed:
        _failed.append(f"{type(error).__name__}: {error}")
        logger.warning(
            "transformers_cb: the native decoder-layer step failed (%s); layers run their modules' forwards "
            "from now on",
            _failed[0],
        )


def _global_hooks() -> bool:
    return bool(
        nn_module._global_forward_hooks
        or nn_module._global_forward_pre_hooks
        or nn_module._global_backward_hooks
        or nn_module._global_backward_pre_hooks
    )


def _step_metadata(kwargs: dict[str, Any]) -> AttentionMetadata | None:
    """The step's metadata when it is the layer's only keyword (anything else goes to the attention
    function, which the direct step does not call)."""
    if len(kwargs) != 1 or METADATA_KWARG not in kwargs:
        return None
    metadata = kwargs[METADATA_KWARG]
    if metadata is None:
        metadata = current_step_metadata()
    return metadata if isinstance(metadata, AttentionMetadata) else None


@dataclass(frozen=True)
class StepInputs:
    """What every layer of one step reads alike, checked once for the step (`step_inputs`)."""

    metadata: AttentionMetadata
    cos: torch.Tensor
    sin: torch.Tensor


def step_inputs(
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None,
    kwargs: dict[str, Any],
) -> StepInputs | None:
    """The step's metadata and cos/sin where the step may take the native layer call (an all-native step,
    cos/sin of the hidden states' dtype, one row each per token, no global hook), else None."""
    metadata = _step_metadata(kwargs)
    if _failed or metadata is None or not metadata.all_native or position_embeddings is None:
        return None
    if metadata.token_row is None or metadata.token_pos is None or _global_hooks():
        return None
    dtype, cos, sin = hidden_states.dtype, *position_embeddings
    if (
        not plain_cpu(cos, dtype)
        or not plain_cpu(sin, dtype)
        or cos.dim() != 3
        or cos.shape != sin.shape
        or cos.shape[0] != 1
        or hidden_states.dim() != 3
        or cos.shape[1] != hidden_states.shape[1]
        or cos.stride(-1) != 1
        or sin.stride(-1) != 1
    ):
        return None
    return StepInputs(metadata, cos, sin)


def direct_step(
    parts: LayerParts,
    ops: ModuleType,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None,
    kwargs: dict[str, Any],
) -> torch.Tensor | None:
    """The layer's output on `hidden_states` `[1, T, hidden]` (its residual stream), or None where any part
    of this call would leave the native paths (the caller then runs the modules' forwards)."""
    inputs = step_inputs(hidden_states, position_embeddings, kwargs)
    return None if inputs is None else layer_step(parts, ops, hidden_states, inputs)


def layer_step(
    parts: LayerParts, ops: ModuleType, hidden_states: torch.Tensor, inputs: StepInputs
) -> torch.Tensor | None:
    """`direct_step` with the step's inputs checked already (a direct model step checks them once for all
    its layers: runner/layer_ops/direct_model.py)."""
    attention = parts.attention
    if (
        _failed  # a native call of an earlier layer of this step failed
        or hidden_states.dim() != 3
        or hidden_states.shape[0] != 1
        or not hidden_states.is_contiguous()
        or attention.training
        or tunes_temperature(attention)
    ):
        return None
    metadata, cos, sin = inputs.metadata, inputs.cos, inputs.sin
    layer_idx = parts.layer_idx
    cache = metadata.cache
    group_metadata = metadata.group_of(layer_idx)
    spec = metadata.kv_group_of(layer_idx)
    dtype = hidden_states.dtype
    tokens, head_dim = hidden_states.shape[1], parts.head_dim
    if (
        group_metadata.sliding_window is not None
        or group_metadata.latent is not None
        or spec.kv_repeat != 1
        or cache.key_dim(cache.layer_group[layer_idx]) is not None
        or cos.shape[1:] != (tokens, head_dim)
        or cos.dtype != dtype
    ):
        return None
    storage, layer = cache.storage_of(layer_idx)
    if cache.scales_of(layer_idx) is not None or storage.dtype != dtype:
        return None  # an int8 cache (or pages of another dtype): the modules' path writes and reads them
    planned = plan_for(parts, dtype, tokens)
    if planned is None:
        return None
    plan, tensors = planned
    specs = plan.specs
    # LlamaDecoderLayer's forward with native_layers' ops, LlamaAttention's with the native rotary and the
    # all-native step's attention, LlamaMLP's with SiLU·mul: one call
    try:
        out: torch.Tensor = ops.decoder_layer(
            hidden_states,
            plan.input_weight,
            parts.input_eps,
            parts.input_gemma,
            plan.post_weight,
            parts.post_eps,
            parts.post_gemma,
            specs.kinds,
            tensors,
            specs.biases,
            specs.outs,
            specs.qtypes,
            plan.qkv_count,
            plan.qkv_split,
            plan.gate_up_count,
            plan.gate_up_split,
            cos,
            sin,
            parts.head_dim,
            storage,
            layer,
            group_metadata.slot_mapping,
            metadata.token_row,
            metadata.token_pos,
            group_metadata.block_table,
            cache.page_size,
            parts.scaling,
            group_metadata.kernel_window,
            plan.tile_rows,
        )
    except RuntimeError as error:
        # An optional part that fails (a torch whose oneDNN op has another signature, say) falls back, once:
        # nothing is lost (a K/V row written before the failure is written again with the same values).
        _fail(error)
        return None
    return out
