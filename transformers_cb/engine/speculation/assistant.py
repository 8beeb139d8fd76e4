"""The engine's draft model (`assistant_model`): what it may be, its settings, and its draft source.

An assistant drafts tokens for the target to verify (scheduler/speculation/shadow_planner.py plans its steps,
runner/drafter.py runs them): it must share the target's
vocabulary (its token ids are the target's: the same `vocab_size`; transformers' universal assisted
decoding across tokenizers is not done here), run under continuous batching itself (the same support
check as any model), and keep only positional state (paged KV: its rejected draft tokens are rolled back
by a token count). A target that cannot speculate (`speculation_refusal`: state layers, tensor
parallelism) refuses an assistant at start. Every refusal is a `ValueError` naming `assistant_model`.

The drafter's pages come out of the engine's cache budget (`memory.sizing.resolve_sizing`'s
`extra_kv_bytes_per_token`): each of its KV groups gets as many pages as the target's, so the shadows of
the running requests fit wherever their requests do (without prefix sharing: a shared prompt is one
copy in the target's pages, one per request in the drafter's; a draft that finds no page is skipped).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from ...config.continuous_batching import ContinuousBatchingConfig
from ...distributed.sharding import tp_size_of
from ...kv.layer_groups import KVGroupSpec, kv_groups_from_config
from ...kv.page_policies import num_pages_for
from ...memory.cache_settings import layout_of
from ...memory.kv_cache import CacheLayout
from ...memory.sizing import ModelShape, Sizing, resolve_group_pages
from ...model_check.model_support import (
    check_model_supported,
    ignores_logits_to_keep,
    observed_layers_of,
    state_layout,
)
from ...runner.drafter import Drafter
from ...scheduler.speculation.shadow_planner import ShadowPlanner
from ..kv_wiring import wire_kv

# Paged backends the assistant runs under: the torch ones (its steps are small; no flash preparation).
_TORCH_BACKENDS = {"eager": "paged|eager", "paged|eager": "paged|eager", "paged|sdpa": "paged|sdpa"}


@dataclass(frozen=True)
class AssistantModelSettings:
    """The assistant's resolved settings: its shape, KV groups, cache layout and block-table widths."""

    shape: ModelShape
    kv_groups: tuple[KVGroupSpec, ...]
    cache: CacheLayout
    group_widths: tuple[int, ...]
    attn_implementation: str
    select_rows: bool


def check_assistant(model: PreTrainedModel, assistant: PreTrainedModel, refusal: str | None) -> ModelShape:
    """Raise `ValueError` naming `assistant_model` when `assistant` cannot draft for `model` (`refusal`:
    why the target cannot speculate, or None); returns the assistant's shape."""
    if not isinstance(assistant, PreTrainedModel):
        raise ValueError(
            f"assistant_model must be a transformers PreTrainedModel, got {type(assistant).__name__}"
        )
    if refusal is not None:
        raise ValueError(f"assistant_model: {refusal}")
    if tp_size_of(assistant) > 1:
        raise ValueError("assistant_model: a tensor-parallel assistant (tp_size > 1) is not supported")
    target_vocab = model.config.get_text_config().vocab_size
    assistant_vocab = assistant.config.get_text_config().vocab_size
    if assistant_vocab != target_vocab:
        raise ValueError(
            f"assistant_model: its vocab_size ({assistant_vocab}) differs from the model's ({target_vocab}); "
            "the assistant must share the model's tokenizer (assistants with another tokenizer are not supported)"
        )
    try:
        check_model_supported(assistant)
        states = state_layout(assistant)
    except NotImplementedError as error:
        raise ValueError(f"assistant_model: {error}") from error
    if states is not None:
        raise ValueError(
            "assistant_model: models with state layers (linear attention, state-space, short convolutions) "
            "cannot draft: a recurrent state that has taken in rejected draft tokens cannot be rolled back"
        )
    return ModelShape.from_config(assistant.config, observed_layers_of(assistant))


def assistant_kv_bytes_per_token(assistant: PreTrainedModel, shape: ModelShape) -> int:
    """Bytes of one token of the assistant's KV (what its pages take from the cache budget per token)."""
    element_size = torch.tensor([], dtype=next(assistant.parameters()).dtype).element_size()
    return shape.kv_bytes_per_token(element_size)


def resolve_assistant(
    assistant: PreTrainedModel,
    shape: ModelShape,
    sizing: Sizing,
    config: ContinuousBatchingConfig,
    workload: list[int] | None,
    model_backend: str | None = None,
) -> AssistantModelSettings:
    """The assistant's settings: its KV groups with the target's page count (`sizing`), block-table widths for
    its context, its backend (`model_backend`: the model's own, when the model is its own assistant: one
    object cannot run two backends; the drafter's steps need a torch one)."""
    groups = tuple(kv_groups_from_config(assistant.config, observed_layers_of(assistant)))
    own = dataclasses.replace(
        sizing,
        max_pages_per_request=min(
            sizing.num_pages, num_pages_for(shape.max_position_embeddings, sizing.page_size)
        ),
    )
    pages, widths = resolve_group_pages(own, list(groups), config, workload)
    first = next(assistant.parameters())
    cache = layout_of(shape, groups, pages, sizing.page_size, first.dtype, first.device)
    current = assistant.config._attn_implementation
    if model_backend is not None:
        if model_backend not in ("paged|sdpa", "paged|eager"):
            raise ValueError(
                f"assistant_model: the model as its own assistant runs one backend, and {model_backend!r} is "
                "not a torch paged backend the drafter can step ('paged|sdpa', 'paged|eager')"
            )
        current = model_backend
    return AssistantModelSettings(
        shape=shape,
        kv_groups=groups,
        cache=cache,
        group_widths=tuple(widths),
        attn_implementation=_TORCH_BACKENDS.get(current, "paged|sdpa"),
        select_rows=ignores_logits_to_keep(assistant),
    )


def build_drafter(
    assistant: PreTrainedModel, settings: AssistantModelSettings, max_batch_tokens: int
) -> ShadowPlanner[Drafter]:
    """The draft model's source from `settings`: its KV parts wired as the target's (`wire_kv`: page pools and
    policies, no prefix sharing, its KV tensors, its packer), the planner owning the pages and the
    drafter (runner/drafter.py) executing its forwards."""
    kv = wire_kv(settings.kv_groups, settings.cache, settings.group_widths, settings.cache.device)
    executor = Drafter(assistant, kv.packer, settings.attn_implementation, settings.select_rows)
    return ShadowPlanner(kv.pages, executor, max_batch_tokens)
