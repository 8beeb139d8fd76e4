"""Which `GenerationConfig` fields the engine honours, ignores safely, or refuses: the one table.

Every field of transformers' `GenerationConfig` is in exactly one of `IMPLEMENTED`, `HARMLESS` or
`REFUSED` (tests/config/test_generation_fields.py walks them all, so a new transformers release that adds a
field fails loudly until it is classified). A field that is *not at its default* (None, transformers'
default, or its value in sampling/neutral.py's one table of neutral values) is accepted only if it is
implemented or harmless; a refused or unknown one raises `UnsupportedGenerationOption` naming it, instead
of being silently ignored (`sampling.neutral.check_generation_config`, which reads this table).

To implement a field: move it from `REFUSED` to `IMPLEMENTED` in the same change that honours it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from transformers import GenerationConfig, PreTrainedModel

# Honoured by the engine (sampler.py, processors.py, warpers.py, stop_strings.py, engine.py, requests.py).
IMPLEMENTED: frozenset[str] = frozenset(
    {
        "max_new_tokens",
        "max_length",
        "eos_token_id",
        "do_sample",
        "temperature",
        "top_k",
        "top_p",
        # Every other logits processor generate() builds (processors.py, docs/sampling.md).
        "min_length",
        "min_new_tokens",
        "stop_strings",
        "top_h",
        "min_p",
        "typical_p",
        "epsilon_cutoff",
        "eta_cutoff",
        "repetition_penalty",
        "encoder_repetition_penalty",
        "no_repeat_ngram_size",
        "encoder_no_repeat_ngram_size",
        "bad_words_ids",
        "sequence_bias",
        "suppress_tokens",
        "begin_suppress_tokens",
        "forced_bos_token_id",
        "forced_eos_token_id",
        "exponential_decay_length_penalty",
        "renormalize_logits",
        "remove_invalid_values",
        "prompt_lookup_num_tokens",  # speculative decoding by prompt lookup (docs/speculative_decoding.md)
        "max_matching_ngram_size",
        # speculative decoding with an assistant_model (engine/speculation/assistant.py); inert without one
        "num_assistant_tokens",
        "num_assistant_tokens_schedule",
        "assistant_confidence_threshold",
        "num_return_sequences",  # forks: siblings share the prompt's pages (kv/prefix_cache.py)
        "continuous_batching_config",  # deprecated path, taken with a FutureWarning (config/interop.py, `take_cb_config`)
    }
)

# Accepted at any value: they do not change which tokens are generated here. Why, per field:
HARMLESS: dict[str, str] = {
    "bos_token_id": "prompts arrive tokenized",
    "pad_token_id": "no padding: requests are packed",
    "decoder_start_token_id": "encoder-decoder only; such models are refused elsewhere",
    "use_cache": "the paged KV cache is always used",
    "cache_implementation": "generate()'s cache choice; the paged cache replaces it",
    "cache_config": "generate()'s cache settings; ContinuousBatchingConfig sizes the paged cache",
    "max_cache_len": "generate()'s static-cache length; the paged cache is sized separately",
    "prefill_chunk_size": "generate()'s chunked prefill; the scheduler chunks by max_batch_tokens",
    "compile_config": "compilation settings; no change to the tokens",
    "disable_compile": "compilation settings; no change to the tokens",
    "output_attentions": "shapes generate()'s return value; GenerationOutput is fixed",
    "output_hidden_states": "shapes generate()'s return value; GenerationOutput is fixed",
    "output_scores": "shapes generate()'s return value; logprobs come from return_logprobs",
    "output_logits": "shapes generate()'s return value; GenerationOutput is fixed",
    "return_dict_in_generate": "shapes generate()'s return value; GenerationOutput is fixed",
    "assistant_lookbehind": "assistants with another tokenizer only; those are refused (engine/speculation/assistant.py)",
    "target_lookbehind": "assistants with another tokenizer only; those are refused (engine/speculation/assistant.py)",
    "is_assistant": "marks a model as someone's assistant; no effect on its own generation",
    "early_stopping": "beam search only (num_beams > 1 is refused)",
    "length_penalty": "beam search only (num_beams > 1 is refused)",
    "low_memory": "beam search / contrastive search only (both refused)",
    "transformers_version": "metadata",
    "_from_model_config": "metadata",
}

# Change the generated tokens, or the generation mode, and are not built: refused when not at default.
REFUSED: frozenset[str] = frozenset(
    {
        "max_time",
        "num_beams",
        "num_beam_groups",
        "diversity_penalty",
        "penalty_alpha",
        "dola_layers",
        "force_words_ids",
        "constraints",
        "guidance_scale",
        "watermarking_config",
        "token_healing",
        "assistant_early_exit",
        "assistant_ensemble_weight",  # verification against a target/draft mixture (lossy): not built
        "speculation_type",
        "use_mtp",
    }
)


class UnsupportedGenerationOption(ValueError, NotImplementedError):
    """A `GenerationConfig` field the engine does not implement is set. A `ValueError` (a bad
    configuration) and, for code written against earlier releases, a `NotImplementedError`."""


def field_names() -> list[str]:
    """The fields transformers' `GenerationConfig` defines (custom entries a model's config may add
    are not generation options and are left alone)."""
    return sorted(vars(GenerationConfig()))


def transformers_defaults() -> dict[str, object]:
    defaults = getattr(GenerationConfig, "_get_default_generation_params", None)
    return defaults() if defaults is not None else {}


@dataclass(frozen=True)
class ResolvedConfig:
    """A `GenerationConfig` already resolved for the model it is handed with (a private copy that
    `resolve_generation_config` returns as it is): a caller that needs the resolved values before the
    engine exists (`generate_batch`: the cache's workload) resolves once and hands this on."""

    config: GenerationConfig


def resolve_generation_config(
    model: PreTrainedModel, generation_config: GenerationConfig | ResolvedConfig | None
) -> GenerationConfig:
    """A private copy: the user's values, then the model's, then transformers' defaults (as `generate()`).
    A `ResolvedConfig` is resolved already: its config comes back as it is."""
    if isinstance(generation_config, ResolvedConfig):
        return generation_config.config
    model_config = getattr(model, "generation_config", None) or GenerationConfig()
    # NOTE: like `generate()`, no config means an empty one, so transformers' defaults (max_length=20,
    # top_k=50, ...) apply after the model's values.
    resolved = copy.deepcopy(generation_config) if generation_config is not None else GenerationConfig()
    has_default_max_length = resolved.max_length is None and model_config.max_length is None
    resolved.update(**model_config.to_dict(), defaults_only=True, allow_custom_entries=True)
    defaults = getattr(GenerationConfig, "_get_default_generation_params", None)
    if defaults is not None:
        resolved.update(**defaults(), defaults_only=True)
    if has_default_max_length and resolved.max_new_tokens is None and resolved.max_length is not None:
        # `generate()` reads transformers' default max_length as that many *new* tokens.
        resolved.max_new_tokens = resolved.max_length
    return resolved


def default_max_new_tokens(config: GenerationConfig, num_prompt_tokens: int) -> int | None:
    """The new-token limit of a request that gives none: `config.max_new_tokens`, else what
    `config.max_length` leaves after the prompt (may be <= 0: the request is then refused), else None.

    `config` is a resolved one (`resolve_generation_config`); `RequestBuilder.__call__` applies this
    to its own, and `generate_batch` to size the cache before an engine exists."""
    if config.max_new_tokens is not None:
        return config.max_new_tokens
    if config.max_length is not None:
        return config.max_length - num_prompt_tokens
    return None
