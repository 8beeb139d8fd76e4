"""Which models continuous batching can run, decided before anything is sized or allocated.

Supported: decoder-only causal LMs (and the text path of vision-language models) whose layers are full
attention, sliding-window attention or chunked attention (Llama 4's `attention_chunk_size`; with logit softcapping and attention sinks where the model
applies them), computed through transformers' attention interface, or state layers (linear attention,
Mamba, short convolutions) that keep their state through transformers' linear-attention cache API, or a
model-owned recurrence with its adapter (model_check/state_probe.py, runner/states/own_state.py,
docs/state_layers.md).

Refused, with the model type and what is missing. From the config alone:
- per-layer attributes (`per_layer_config`) other than the KV head shape (`head_dim`,
  `num_key_value_heads`: Gemma 4's 512 on full layers gets its own KV groups): read globally they
  raise transformers' `AmbiguousGlobalPerLayerAttributeError`, and nothing reads them per layer yet;
- encoder-decoder models (the cache holds one self-attention KV stream per request);
- recurrent models that keep their state in a cache of their own with no adapter for it (PLaMo 2;
  MiniMax, RecurrentGemma, RWKV and xLSTM have theirs: runner/states/own_state.py);
- attention the kernels do not implement: bidirectional attention, ALiBi of a family without an adapter
  (Bloom's, MPT's and Falcon's bfloat16-rounded form run: attention/families/classic.py), cross-attention, or any
  unknown `layer_types` entry (`kv/layer_groups.py`; `indexed_attention` without a latent among them).
Multi-latent attention (`kv_lora_rank`) runs on latent pages (attention/families/latent.py): each KV layer must have
an MLA module whose `expand_kv` decompresses as the absorbed attention reads it (`latent_problems`);
DeepSeek sparse attention's indexers select from their keys in those pages (attention/families/sparse_index.py).
From what the model's forward does (when the model is given; `attention_probe.py`, `state_probe.py`):
- state layers whose modules do not keep their state through the cache API, or that do not take
  (hidden_states, cache, attention_mask); state layers under tensor parallelism;
- attention that never reaches transformers' attention interface (classes with `_supports_attention_backend`
  False compute it themselves; the classic families run through their adapters, attention/families/classic.py, and
  the others are refused naming what they miss: an encoder's `is_decoder=False`, XLM's `causal=False`,
  XLNet's `attn_type='bi'`, CPM-Ant's relative-position buckets, or else no adapter);
- a forward that breaks the paged contract: attention run outside the forward's thread and context (the
  step's metadata is out of reach: its layers count as missing), two attention calls per layer, V with
  other heads than K's, a window other than the config's, bidirectional layers, an attention bias in
  the mask (ALiBi), positions numbered another way than 0..n-1.
K/V head shapes other than the config's are taken from the forward instead (`observed_layers_of`: the
engine sizes its cache from them; V's own head size, K/V a layer tiles before the call), and so is a window applied through the mask alone (no kwarg).
Two clauses are adapted instead of refused (runner/forward/model_call.py): layers that drop the attention kwargs
(StableLM, Nemotron) reach the step's metadata through a context variable, and a forward that ignores
`logits_to_keep` has its rows selected by the runner (`ignores_logits_to_keep`).
The class flag alone is not the rule: composite models (Janus, DeepSeek-VL) leave it False on the outer
class while their text model dispatches through the interface, and BioGPT or PLBart dispatch without it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from transformers import PretrainedConfig, PreTrainedModel

from ..attention.families.classic import has_classic_attention
from ..attention.families.latent import latent_module_problem, latent_modules
from ..attention.families.sparse_index import indexer_modules, indexer_problem
from ..distributed.sharding import tp_size_of
from ..kv.layer_groups import (
    HEAD_SHAPE_ATTRIBUTES,
    INDEXED_ATTENTION,
    ObservedLayers,
    kv_groups_from_config,
    kv_layer_indices,
    latent_shape_of,
    layer_to_group,
    layer_types_of,
    state_layer_indices,
)
from ..memory.sizing import ModelShape
from .attention_probe import dispatch_problems, observed_layers, probe_token_ids, run_probe
from .state_probe import StateLayout, probe_states, state_problems

# Recurrent models whose state is kept neither through transformers' linear-attention cache API nor by a
# model-owned recurrence the state slots carry (runner/states/own_state.py: MiniMax, RecurrentGemma, RWKV, xLSTM).
OWN_STATE_MODEL_TYPES = frozenset({"plamo2"})
# Config flags of ALiBi (a per-head linear bias added to the attention logits): Falcon's `alibi`, MPT's
# `attn_config.alibi`, BERT-style `position_embedding_type`. The kernels add it for the families whose
# adapter passes their slopes (attention/families/classic.py: Bloom, whose config has no flag, MPT, and Falcon with
# its own form of the bias, `alibi.AlibiForm`).
ALIBI_FLAGS = ("alibi", "use_alibi")
ALIBI_MODEL_TYPES = frozenset({"bloom", "mpt", "falcon"})
# DeepSeek V4's layer types: attention over compressed entries of the past (a compressor's, not a page's).
COMPRESSED_LAYER_TYPES = frozenset({"compressed_sparse_attention", "heavily_compressed_attention"})


@dataclass(frozen=True)
class _Verdict:
    fingerprint: str | None  # None: a config JSON cannot hold (the verdict is then never reused)
    problems: list[str]
    ignores_logits_to_keep: bool
    states: StateLayout | None  # the model's state layers (None: none)
    observed: ObservedLayers | None = None  # what the forward showed that overrides the config


# The probe's verdict per model object and config (its forward does not change between engines; a config
# edited in between is probed again).
_probed: weakref.WeakKeyDictionary[PreTrainedModel, _Verdict] = weakref.WeakKeyDictionary()


def _refuse(model_type: str, missing: str) -> None:
    raise NotImplementedError(f"continuous batching cannot run model_type={model_type}: {missing}")


def _named(config: PretrainedConfig, text_config: PretrainedConfig) -> str:
    """`'qwen2'`, or `'qwen2' (the text model of 'video_llama_3')` for a composite model."""
    text_type = getattr(text_config, "model_type", None) or getattr(config, "model_type", "?")
    outer = getattr(config, "model_type", None)
    if outer and outer != text_type:
        return f"{text_type!r} (the text model of {outer!r})"
    return repr(text_type)


def check_model_supported(model: PreTrainedModel | PretrainedConfig) -> None:
    """Raise `NotImplementedError` naming the model type and what is missing, or return.

    Args:
        model: the model (every rule), or only its config (the config's rules).
    """
    config = model.config if isinstance(model, PreTrainedModel) else model
    text_config = config.get_text_config()
    model_type = _named(config, text_config)
    _check_config(config, text_config, model_type)
    kv_groups = kv_groups_from_config(config)  # raises on layer types the kernels do not know
    if not isinstance(model, PreTrainedModel):
        return
    problems = _probe_problems(model, config, kv_groups)
    if problems:
        _refuse(model_type, "; ".join(problems))
    if tp_size_of(model) > 1 and state_layer_indices(config):
        _refuse(model_type, "state layers under tensor parallelism (tp_size > 1) are not supported yet")


def _no_interface_reason(model: PreTrainedModel) -> str:
    """Why a model's attention never reached the attention interface, as far as its class says."""
    encoder_modules = sorted(
        {
            type(m).__name__
            for m in model.modules()
            if "Attention" in type(m).__name__ and m.__dict__.get("is_decoder") is False
        }
    )
    if encoder_modules:
        # BERT-style self-attention: causal only when built as a decoder (`is_decoder`), otherwise every token
        # attends to every other, which no paged cache of earlier tokens reproduces.
        return (
            f"its attention is bidirectional ({', '.join(encoder_modules)} built with is_decoder=False), not "
            "causal generation"
        )
    text = model.config.get_text_config()
    # XLM's `causal`, XLNet's `attn_type`: flags of masked-language-model attention (every token sees all).
    for flag, bidirectional in (("causal", False), ("attn_type", "bi")):
        if flag in text.to_dict() and getattr(text, flag) == bidirectional:
            return f"its attention is bidirectional ({flag}={bidirectional!r}), not causal generation"
    for buckets in ("relative_attention_num_buckets", "position_bias_num_buckets"):
        if getattr(text, buckets, None):
            # CPM-Ant: a bias looked up per head and (query, key) distance bucket, not a linear one like ALiBi.
            return (
                f"it adds a learned relative-position bias ({buckets}={getattr(text, buckets)}) to its attention "
                "logits, which the paged kernels do not add"
            )
    if not getattr(type(model), "_supports_attention_backend", False):
        # transformers sets the flag on classes whose attention modules call `ALL_ATTENTION_FUNCTIONS`; the
        # others compute attention themselves (ALiBi, learned or interleaved-rotary variants, their own KV).
        return (
            f"{type(model).__name__} computes attention itself instead of through transformers' attention "
            "interface (`_supports_attention_backend` is False), so the paged KV cache is never used"
        )
    return "its attention does not go through transformers' attention interface"


def _check_config(config: PretrainedConfig, text_config: PretrainedConfig, model_type: str) -> None:
    # First: on a heterogeneous config, reading a per-layer attribute globally (as every rule below and
    # `ModelShape` do) raises transformers' `AmbiguousGlobalPerLayerAttributeError`.
    # Per-layer head shapes are supported (`kv/layer_groups.py`: one KV group per head shape); any
    # other per-layer attribute (a per-layer window, MLP size, ...) is not read per layer yet.
    per_layer = set(getattr(text_config, "per_layer_attributes", None) or ()) - HEAD_SHAPE_ATTRIBUTES
    if per_layer:
        _refuse(
            model_type,
            f"per-layer attributes {sorted(per_layer)} (per_layer_config) are not supported yet: only the "
            f"KV head shape ({sorted(HEAD_SHAPE_ATTRIBUTES)}) may vary per layer",
        )
    if getattr(config, "is_encoder_decoder", False):
        _refuse(model_type, "encoder-decoder models are not supported (decoder-only causal LMs only)")
    if getattr(text_config, "model_type", None) in OWN_STATE_MODEL_TYPES:
        _refuse(
            model_type,
            "its recurrent layers keep their state in a cache of the model's own, neither through "
            "transformers' linear-attention cache API nor through an adapter of runner/states/own_state.py, which "
            "the per-request state slots hold",
        )
    if getattr(text_config, "use_bidirectional_attention", False):
        _refuse(model_type, "bidirectional attention is not causal generation")
    if latent_shape_of(text_config) is not None and INDEXED_ATTENTION in layer_types_of(text_config):
        # Why: the indexer's keys are stored after each latent row (`KVGroupSpec.index_dim`), sized by it.
        index_dim = getattr(text_config, "index_head_dim", None)
        if not isinstance(index_dim, int) or index_dim < 1:
            _refuse(
                model_type,
                f"DeepSeek sparse attention (indexed_attention layers) with index_head_dim={index_dim!r}: the "
                "latent pages store each token's indexer key of that size",
            )
    compressed = sorted(set(layer_types_of(text_config)) & COMPRESSED_LAYER_TYPES)
    if compressed:
        # DeepSeek V4: beside its sliding-window K=V, a layer attends compressed entries that a compressor emits
        # once per `compress_rates[type]` tokens, from a window of source tokens it buffers across calls.
        _refuse(
            model_type,
            f"DeepSeek V4's compressed attention ({compressed} layers) is not implemented: besides its "
            "sliding-window K=V pages, each layer attends compressed KV entries, one per "
            f"compress_rates={getattr(text_config, 'compress_rates', None)!r} source tokens, made by a compressor "
            "that buffers the unclosed window (and, for compressed_sparse_attention, the previous window's "
            "overlapping half) across calls, and a Lightning Indexer picks each query's top-k compressed entries: "
            "the paged cache has no page group of compressed entries, no per-request compressor state, and no "
            "top-k over compressed entries",
        )
    # Why: an ALiBi bias is added to the logits inside the model's own attention; the paged kernels
    # compute softmax(QK^T) without it.
    attn_config = getattr(text_config, "attn_config", None)
    if getattr(text_config, "model_type", None) not in ALIBI_MODEL_TYPES and (
        any(getattr(text_config, flag, False) is True for flag in ALIBI_FLAGS)
        or getattr(attn_config, "alibi", False) is True
        or getattr(text_config, "position_embedding_type", None) == "alibi"
    ):
        _refuse(model_type, _alibi_refusal(text_config))
    # Why: cross-attention reads an encoder's states, which are not part of the paged self-attention cache.
    if getattr(text_config, "add_cross_attention", False):
        _refuse(
            model_type, "cross-attention (add_cross_attention) needs the encoder's states, not a paged cache"
        )


def _alibi_refusal(text_config: PretrainedConfig) -> str:
    """Why an ALiBi config is refused."""
    return "ALiBi biases of this family are not passed to the paged kernels (no adapter in attention/families/classic.py)"


def _probe_problems(model: PreTrainedModel, config: PretrainedConfig, kv_groups: list) -> list[str]:
    """The probe's findings (cached per model). Skipped under tensor parallelism (a forward there is a
    collective every rank must join) and for weights not materialised (meta device)."""
    try:
        fingerprint: str | None = config.to_json_string()
    except (TypeError, ValueError):  # a config holding what JSON cannot: probe every time, cache nothing
        fingerprint = None
    cached = _probed.get(model)
    if fingerprint is not None and cached is not None and cached.fingerprint == fingerprint:
        return cached.problems
    first = next(model.parameters(), None)
    if first is None or first.device.type == "meta" or tp_size_of(model) > 1:
        return []
    shape = ModelShape.from_config(config)
    num_layers = shape.num_layers
    kv_layers = kv_layer_indices(config)
    windows = [
        kv_groups[g].sliding_window if g >= 0 else None
        for g in layer_to_group(kv_groups, num_layers, kv_layers)
    ]
    layout, problems = state_problems(model, config)
    if problems:
        _probed[model] = _Verdict(fingerprint, problems, False, None)
        return problems
    with probe_states(layout, len(probe_token_ids(model)), first.device):
        result = run_probe(model)
    observed = None
    # A classic family's modules attend through the interface while the probe runs (attention/families/classic.py):
    # a forward that fails there failed for its own reason (BLIP's decoder asks for `pixel_values`).
    reaches_interface = getattr(type(model), "_supports_attention_backend", False) or has_classic_attention(
        model
    )
    if not result.calls and kv_layers and (result.error is None or not reaches_interface):
        problems = [_no_interface_reason(model)]
    else:
        kv_shapes = [shape.layer_head_shape(i) for i in range(num_layers)]
        if shape.latent is not None:
            # The probe sees the decompressed K/V (V of its own size, by design); the cache holds the latent.
            problems = latent_problems(model, kv_layers) or dispatch_problems(
                result, num_layers, None, windows, kv_layers, layout is not None
            )
        else:
            problems = dispatch_problems(
                result, num_layers, kv_shapes, windows, kv_layers, layout is not None
            )
            observed = None if problems else observed_layers(result, kv_shapes)
    # Kept even without a fingerprint (never reused by the check then): the engine reads this probe's
    # observations right after it (`observed_layers_of`).
    _probed[model] = _Verdict(fingerprint, problems, not result.keeps_rows, layout, observed)
    return problems


def latent_problems(model: PreTrainedModel, kv_layers: list[int]) -> list[str]:
    """What keeps a multi-latent model's KV layers from the latent pages: a layer without an MLA module
    (`attention/families/latent.py: is_latent_module`), or one whose latent the absorbed attention cannot read; a
    DeepSeek sparse attention model's indexer the pass-through cannot hand one request at a time
    (`attention/families/sparse_index.py: indexer_problem`), or an indexer on a layer whose pages hold no indexer keys."""
    indexed = {
        i for i, t in enumerate(layer_types_of(model.config.get_text_config())) if t == INDEXED_ATTENTION
    }
    for indexer in indexer_modules(model):
        problem = indexer_problem(indexer)
        if problem is None and indexer.layer_idx not in indexed:
            problem = (
                f"it scores the keys of layer {indexer.layer_idx}, which is not an indexed_attention layer"
            )
        if problem is not None:
            return [f"DeepSeek sparse attention's indexer: {problem}"]
    by_layer = {getattr(m, "layer_idx", None): m for m in latent_modules(model)}
    missing = [i for i in kv_layers if i not in by_layer]
    if missing:
        return [
            f"layers {missing} have no multi-latent attention module (kv_b_proj, expand_kv) although the "
            "config sets kv_lora_rank, so their KV is not one latent per token"
        ]
    rope = (latent_shape_of(model.config.get_text_config()) or (0, 0))[1]
    narrower = [i for i in kv_layers if getattr(by_layer[i], "qk_rope_head_dim", rope) != rope]
    if narrower:
        # Mistral Large 4's `no_rope_layers`: those layers cache no rotary key.
        return [
            f"layers {narrower} cache a latent of kv_lora_rank + {by_layer[narrower[0]].qk_rope_head_dim} values "
            f"per token (layers without rotary keys), others of kv_lora_rank + {rope}: latent rows of "
            "another width per layer are not supported (one latent group holds one row width)"
        ]
    for i in kv_layers:
        problem = latent_module_problem(by_layer[i])
        if problem is not None:
            return [f"layer {i}: {problem}"]
    return []


def observed_layers_of(model: PreTrainedModel) -> ObservedLayers | None:
    """The KV head shapes the support check saw the model's forward attend with where its config says
    otherwise (`kv/layer_groups.py: ObservedLayers`); None when it was not probed (meta weights, tensor
    parallelism), or its config changed since: the config alone then sizes the cache."""
    verdict = _probed.get(model)
    try:
        fingerprint: str | None = model.config.to_json_string()
    except (TypeError, ValueError):
        fingerprint = None
    if verdict is None or verdict.fingerprint != fingerprint or verdict.problems:
        return None
    return verdict.observed


def ignores_logits_to_keep(model: PreTrainedModel) -> bool:
    """The probe saw the model's forward return every position's logits whatever `logits_to_keep` says
    (the runner then selects the rows itself: runner/forward/model_call.py). False when it was not probed (meta
    weights, tensor parallelism): the runner still selects rows whose count betrays it."""
    verdict = _probed.get(model)
    return verdict is not None and verdict.ignores_logits_to_keep


def state_layout(model: PreTrainedModel) -> StateLayout | None:
    """The model's state layers and their states' shapes (model_check/state_probe.py), learned by the support
    check (probed again here when the check was skipped or its config changed); None: no state layers."""
    verdict = _probed.get(model)
    try:
        fingerprint: str | None = model.config.to_json_string()
    except (TypeError, ValueError):
        fingerprint = None
    if verdict is not None and verdict.fingerprint == fingerprint and not verdict.problems:
        return verdict.states
    layout, problems = state_problems(model, model.config)
    if problems:
        _refuse(_named(model.config, model.config.get_text_config()), "; ".join(problems))
    return layout
