"""The logits-processing pipeline `generate()` would build for a decoder-only model, as stages.

`build_stages` walks a `GenerationConfig` in the order of transformers'
`GenerationMixin._get_logits_processor` and turns each processor into one of three stages:

- `vector`: the processors a request may override (repetition penalty, temperature, top-k, top-p,
  min-p), computed for all rows at once by `warpers.py` with one value per row;
- `shared`: processors that read only the scores (suppress_tokens, typical_p, epsilon/eta cutoff,
  top_h, remove_invalid_values, renormalize_logits): one transformers processor over all rows;
- `openai` (with `per_request_processors`): OpenAI's per-request logit_bias, min_tokens, presence and
  frequency penalties (sampling/logits/openai.py), all rows at once;
- `row`: processors that read the sequence (no_repeat_ngram, min length, bad words, sequence bias,
  forced bos/eos, exponential decay, begin_suppress_tokens, the user's own `logits_processor`):
  each request gets its own instance, called with exactly its prompt + generated tokens, as
  `generate()` calls it for a batch of one.

A user processor whose type equals one `generate()` creates replaces it in place, the others
follow the built ones, before the sampling warpers (transformers' merge rule).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import torch
from transformers import GenerationConfig
from transformers.generation import logits_process as lp

from ...invariants import present
from ..neutral import NEUTRAL_VALUES
from ..params import enabled_vector_params


@dataclass(frozen=True)
class RowContext:
    """What a per-request processor is built from: the request as `generate()` would see it."""

    prompt_ids: list[int]
    eos_token_ids: tuple[int, ...]
    max_new_tokens: int
    # transformers' processors annotate their `device` as str but only hand it to `torch.tensor`, which takes a
    # torch.device: passing this one needs a `type: ignore[arg-type]`.
    device: torch.device

    @property
    def eos(self) -> torch.Tensor | None:
        if not self.eos_token_ids:
            return None
        return torch.tensor(self.eos_token_ids, dtype=torch.long, device=self.device)


RowFactory = Callable[[RowContext], "lp.LogitsProcessor | None"]


@dataclass(frozen=True)
class Stage:
    kind: str  # "vector" | "shared" | "row" | "openai"
    name: str  # a `VECTOR_PARAMS` name for vector stages, else the processor's class name
    processor: lp.LogitsProcessor | None = None  # shared stages
    factory: RowFactory | None = None  # row stages: the request's own instance (None: inactive for it)


def _prompt_tensor(ctx: RowContext) -> torch.LongTensor:
    """The prompt as `generate()`'s `[1, len]` input ids (int64 from Python ints; transformers' processors
    annotate them `LongTensor`)."""
    return cast(torch.LongTensor, torch.tensor([ctx.prompt_ids], device=ctx.device))


def _vector(name: str) -> Stage:
    return Stage("vector", name)


def _shared(processor: lp.LogitsProcessor) -> Stage:
    return Stage("shared", type(processor).__name__, processor=processor)


def _row(cls: type, factory: RowFactory) -> Stage:
    return Stage("row", cls.__name__, factory=factory)


def _same_instance(processor: lp.LogitsProcessor) -> Stage:
    return _row(type(processor), lambda ctx: processor)


def _history_stages(config: GenerationConfig, all_request_stages: bool) -> list[tuple[type, Stage]]:
    """The processors `generate()` builds before merging the user's list, with their types."""
    stages: list[tuple[type, Stage]] = []
    enabled = enabled_vector_params(config, all_request_stages)
    if config.sequence_bias is not None:
        bias = lp.SequenceBiasLogitsProcessor(sequence_bias=config.sequence_bias)
        stages.append((lp.SequenceBiasLogitsProcessor, _same_instance(bias)))
    penalty = config.encoder_repetition_penalty
    if penalty is not None and penalty != NEUTRAL_VALUES["encoder_repetition_penalty"]:
        # Decoder-only: `generate()` passes the prompt as the "encoder" input ids.
        stages.append(
            (
                lp.EncoderRepetitionPenaltyLogitsProcessor,
                _row(
                    lp.EncoderRepetitionPenaltyLogitsProcessor,
                    lambda ctx: lp.EncoderRepetitionPenaltyLogitsProcessor(penalty, _prompt_tensor(ctx)),
                ),
            )
        )
    if "repetition_penalty" in enabled:
        stages.append((lp.RepetitionPenaltyLogitsProcessor, _vector("repetition_penalty")))
    if config.no_repeat_ngram_size:
        ngram = lp.NoRepeatNGramLogitsProcessor(config.no_repeat_ngram_size)
        stages.append((lp.NoRepeatNGramLogitsProcessor, _same_instance(ngram)))
    size = config.encoder_no_repeat_ngram_size
    if size:
        stages.append(
            (
                lp.EncoderNoRepeatNGramLogitsProcessor,
                _row(
                    lp.EncoderNoRepeatNGramLogitsProcessor,
                    lambda ctx: lp.EncoderNoRepeatNGramLogitsProcessor(size, _prompt_tensor(ctx)),
                ),
            )
        )
    if config.bad_words_ids is not None:
        words = config.bad_words_ids
        factory: RowFactory = lambda ctx: lp.NoBadWordsLogitsProcessor(words, ctx.eos)  # noqa: E731
        stages.append((lp.NoBadWordsLogitsProcessor, _row(lp.NoBadWordsLogitsProcessor, factory)))
    if config.min_length:
        min_length = config.min_length
        factory = lambda ctx: (  # noqa: E731
            lp.MinLengthLogitsProcessor(
                min_length,
                present(ctx.eos, "eos_token_ids is non-empty"),
                device=ctx.device,  # type: ignore[arg-type]  # see RowContext.device
            )
            if ctx.eos_token_ids
            else None
        )
        stages.append((lp.MinLengthLogitsProcessor, _row(lp.MinLengthLogitsProcessor, factory)))
    if config.min_new_tokens:
        min_new = config.min_new_tokens
        factory = lambda ctx: (  # noqa: E731
            lp.MinNewTokensLengthLogitsProcessor(
                len(ctx.prompt_ids),
                min_new,
                present(ctx.eos, "eos_token_ids is non-empty"),
                device=ctx.device,  # type: ignore[arg-type]  # see RowContext.device
            )
            if ctx.eos_token_ids
            else None
        )
        stages.append(
            (lp.MinNewTokensLengthLogitsProcessor, _row(lp.MinNewTokensLengthLogitsProcessor, factory))
        )
    if config.forced_bos_token_id is not None:
        bos = lp.ForcedBOSTokenLogitsProcessor(config.forced_bos_token_id)
        stages.append((lp.ForcedBOSTokenLogitsProcessor, _same_instance(bos)))
    if config.forced_eos_token_id is not None:
        forced_eos = config.forced_eos_token_id
        # `generate()` turns max_new_tokens into max_length = prompt + max_new_tokens.
        factory = lambda ctx: lp.ForcedEOSTokenLogitsProcessor(  # noqa: E731
            len(ctx.prompt_ids) + ctx.max_new_tokens,
            forced_eos,
            device=ctx.device,  # type: ignore[arg-type]  # see RowContext.device
        )
        stages.append((lp.ForcedEOSTokenLogitsProcessor, _row(lp.ForcedEOSTokenLogitsProcessor, factory)))
    if config.remove_invalid_values is True:
        stages.append((lp.InfNanRemoveLogitsProcessor, _shared(lp.InfNanRemoveLogitsProcessor())))
    if config.exponential_decay_length_penalty is not None:
        decay = config.exponential_decay_length_penalty
        # As `generate()`, it passes its eos tensor even when there is none (transformers then raises, as in
        # `generate()`), which transformers' annotation does not allow for.
        factory = lambda ctx: lp.ExponentialDecayLengthPenalty(  # noqa: E731
            decay,
            ctx.eos,  # type: ignore[arg-type]
            len(ctx.prompt_ids),
        )
        stages.append((lp.ExponentialDecayLengthPenalty, _row(lp.ExponentialDecayLengthPenalty, factory)))
    if config.suppress_tokens is not None:
        suppress = lp.SuppressTokensLogitsProcessor(config.suppress_tokens)
        stages.append((lp.SuppressTokensLogitsProcessor, _shared(suppress)))
    if config.begin_suppress_tokens is not None:
        begin_tokens, has_bos = config.begin_suppress_tokens, config.forced_bos_token_id is not None

        def begin_suppress(ctx: RowContext) -> lp.LogitsProcessor:
            begin = len(ctx.prompt_ids)
            begin = begin if (begin > 1 or not has_bos) else begin + 1
            return lp.SuppressTokensAtBeginLogitsProcessor(
                begin_tokens,
                begin,
                device=ctx.device,  # type: ignore[arg-type]  # see RowContext.device
            )

        stages.append(
            (
                lp.SuppressTokensAtBeginLogitsProcessor,
                _row(lp.SuppressTokensAtBeginLogitsProcessor, begin_suppress),
            )
        )
    return stages


def _warper_stages(config: GenerationConfig, all_request_stages: bool) -> list[Stage]:
    """The sampling warpers, applied after the user's processors, only when do_sample (with
    `all_request_stages`, the vectorized ones also without: a request may sample on its own)."""
    enabled = enabled_vector_params(config, all_request_stages)
    if not config.do_sample:
        return [_vector(name) for name in ("temperature", "top_k", "top_p", "min_p") if name in enabled]
    stages = [_vector("temperature")] if "temperature" in enabled else []
    if config.top_h is not None:
        stages.append(_shared(lp.TopHLogitsWarper(top_h=config.top_h)))
    stages += [_vector(name) for name in ("top_k", "top_p", "min_p") if name in enabled]
    if config.typical_p is not None and config.typical_p < 1.0:
        stages.append(_shared(lp.TypicalLogitsWarper(mass=config.typical_p)))
    if config.epsilon_cutoff is not None and 0.0 < config.epsilon_cutoff < 1.0:
        stages.append(_shared(lp.EpsilonLogitsWarper(epsilon=config.epsilon_cutoff)))
    if config.eta_cutoff is not None and 0.0 < config.eta_cutoff < 1.0:
        stages.append(_shared(lp.EtaLogitsWarper(epsilon=config.eta_cutoff)))
    return stages


def build_stages(
    config: GenerationConfig,
    user_processors: Sequence[lp.LogitsProcessor] = (),
    openai: bool = False,
    all_request_stages: bool = False,
) -> list[Stage]:
    """The ordered stages for `config` plus the user's `logits_processor` list; `openai`: the
    per-request OpenAI processors (logit_bias, min_tokens, presence / frequency penalties) after
    them and before the sampling warpers, where OpenAI and vLLM apply them (on the unscaled logits).
    `all_request_stages`: every vectorized stage, in its place, whatever `config`'s values (the server's
    engine, whose requests bring their own values)."""
    merged: list[Stage] = []
    used: list[lp.LogitsProcessor] = []
    for cls, stage in _history_stages(config, all_request_stages):
        custom = next((p for p in user_processors if type(p) is cls), None)
        if custom is not None:
            used.append(custom)
            stage = _same_instance(custom)
        merged.append(stage)
    merged += [_same_instance(p) for p in user_processors if not any(p is u for u in used)]
    if openai:
        merged.append(Stage("openai", "openai"))
    merged += _warper_stages(config, all_request_stages)
    if config.renormalize_logits is True:
        merged.append(_shared(lp.LogitNormalization()))
    return merged
