"""A Llama-form causal LM's step as its modules' calls, without the model's two forwards around them: the
embedding, the rotary embedding, each decoder layer on `direct_step` (its checks of the step once for all
layers: `step_inputs`, then `layer_step` per layer), the final norm, the kept rows and the LM head.

`LlamaForCausalLM.forward` and `LlamaModel.forward` with their decorators (config defaults, output capture,
return types) and the decoder layers' module calls cost ~1 ms of Python a step on the small benchmark model,
whose 32-row decode step takes ~13 ms. On a step whose every layer takes `direct_step`, nothing they add is
read: the causal mask they build (the native attention masks by construction), the cache they would make
(`use_cache=False`), the outputs they could capture (none asked). So the same module calls in the same order
give the same bits (tests/runner/test_direct_model.py); only calls are saved.

It applies to a model whose class forward is `LlamaForCausalLM`'s code (its docstring aside) over a model
whose forward is `LlamaModel`'s, every decoder layer on the run's native layer forward with its parts
recognised (runner/layer_ops/layer_plan.py `layer_parts`), with no hook on its inner model or a layer (the
other modules are called, hooks and all; the runner calls the model's forward, never its hooks), on the eager forward (not compiled, no graph, no
adapter or media rows: runner/model_runner.py picks). Decided at a run's first step; where any step's layer
would leave the native call it returns None before the LM head and the runner calls the model's forward,
which writes the layers' K/V rows again with the same values. `TRANSFORMERS_CB_DIRECT_LAYERS=0` turns it
off with the direct layers.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from transformers.modeling_utils import slice_logits_to_keep

from ...attention.metadata import AttentionMetadata
from ...attention.native.kernel import native_module
from ...attention.paged import METADATA_KWARG, step_metadata
from ...patches import in_force
from .direct_layer import layer_step, step_inputs
from .layer_forms import has_hooks, references, same_function
from .layer_plan import LayerParts, layer_parts
from .native_layers import KIND, enabled_direct


@dataclass(frozen=True)
class DirectLayer:
    module: nn.Module
    forward: object  # the run's native layer forward, the module's instance attribute
    parts: LayerParts


@dataclass(frozen=True)
class ModelParts:
    """The modules a direct model step calls, read at a run's first step."""

    model: nn.Module
    inner: nn.Module
    embed: nn.Module
    rotary: nn.Module
    norm: nn.Module
    head: nn.Module
    layers: tuple[DirectLayer, ...]


def _module(owner: nn.Module, name: str) -> nn.Module | None:
    child = owner._modules.get(name)
    return child if isinstance(child, nn.Module) else None


def model_parts(model: nn.Module) -> ModelParts | None:
    """`model`'s parts if it is a Llama-form causal LM whose every decoder layer runs the native layer ops
    (the run's patches in force), else None."""
    ref = references()
    inner = _module(model, "model")
    if (
        inner is None
        or "forward" in model.__dict__
        or "forward" in inner.__dict__
        or not same_function(type(model).forward, ref.llama_causal_lm, docstrings=False)
        or not same_function(type(inner).forward, ref.llama_model, docstrings=False)
    ):
        return None
    embed, rotary, norm = (_module(inner, name) for name in ("embed_tokens", "rotary_emb", "norm"))
    head, stack = _module(model, "lm_head"), _module(inner, "layers")
    count = getattr(getattr(inner, "config", None), "num_hidden_layers", None)
    if (
        embed is None
        or rotary is None
        or norm is None
        or head is None
        or not isinstance(stack, nn.ModuleList)
        or not isinstance(count, int)
    ):
        return None
    layers = []
    for layer in list(stack)[:count]:
        if not in_force(KIND, layer, "forward"):
            return None
        parts = layer_parts(layer, KIND)
        if parts is None:
            return None
        layers.append(DirectLayer(layer, layer.__dict__["forward"], parts))
    return ModelParts(model, inner, embed, rotary, norm, head, tuple(layers))


def _unchanged(parts: ModelParts) -> bool:
    """Nothing the step skips has gained a hook or another forward since the run's first step (the model's
    own hooks are not among them: the runner calls its forward, not the module)."""
    if has_hooks(parts.inner):
        return False
    if "forward" in parts.model.__dict__ or "forward" in parts.inner.__dict__:
        return False
    return all(
        layer.module.__dict__.get("forward") is layer.forward and not has_hooks(layer.module)
        for layer in parts.layers
    )


def direct_model_logits(
    parts: ModelParts,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    keep: torch.Tensor,
    metadata: AttentionMetadata,
) -> torch.Tensor | None:
    """The logits `[len(keep), vocab]` of the step, or None where it would leave the native layers (the
    caller then calls the model's forward)."""
    ops = native_module()
    if ops is None or torch.is_grad_enabled() or torch.compiler.is_compiling() or not _unchanged(parts):
        return None
    # the step's metadata set: the embedding and rotary modules' run patches read it (per-request rotary)
    with step_metadata(metadata):
        hidden = parts.embed(input_ids)
        position_embeddings = parts.rotary(hidden, position_ids=position_ids)
        inputs = step_inputs(hidden, position_embeddings, {METADATA_KWARG: metadata})  # once for every layer
        if inputs is None:
            return None
        for layer in parts.layers:
            out = layer_step(layer.parts, ops, hidden, inputs)
            if out is None:
                return None
            hidden = out
        hidden = parts.norm(hidden)
        logits: torch.Tensor = parts.head(slice_logits_to_keep(hidden, keep))
    return logits[0]


_UNDECIDED = object()


class DirectModel:
    """The runner's direct model steps: the model's parts decided at each run's first step (every patch of
    the run is in force by then), forgotten at its end."""

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._parts: object = _UNDECIDED

    @contextmanager
    def session(self) -> Iterator[None]:
        self._parts = _UNDECIDED
        try:
            yield
        finally:
            self._parts = _UNDECIDED

    def logits(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        keep: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor | None:
        """The step's logits at `keep` through the model's modules (`direct_model_logits`), or None: call the
        model's forward."""
        if self._parts is _UNDECIDED:
            self._parts = model_parts(self._model) if enabled_direct() else None
        if not isinstance(self._parts, ModelParts):
            return None
        return direct_model_logits(self._parts, input_ids, position_ids, keep, metadata)
