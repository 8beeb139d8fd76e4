"""`generate_batch`: run many prompts to completion with continuous batching, in the caller's thread.

It owns the per-input arguments (one value for all inputs, or one per input), the cache sizing from
the known workload, and the engine kept on the model for `persistent_manager=True`.

NOTE: the loop runs in the caller's thread on purpose. A forward issued from a
second OS thread is slower: grad / inference mode are thread-local (a bare thread
records autograd graphs), and each thread that runs torch ops gets its own OpenMP
team; with two teams alive, libgomp throttles every thread's spin-wait (or, with
OMP_WAIT_POLICY=active, the idle team spins on a core): 1.02-1.47x measured on an
idle 2-core machine, 1.9-2.3x with an active wait policy. The manager's thread
avoids it with `threads.ThreadSettings`; see docs/design.md, "Threads and speed".
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, cast

from tqdm.auto import tqdm
from transformers import GenerationConfig, PreTrainedModel

from ..config.continuous_batching import ContinuousBatchingConfig
from ..config.generation_fields import ResolvedConfig, default_max_new_tokens, resolve_generation_config
from ..config.interop import take_cb_config
from ..engine.build import build_engine
from ..engine.engine import Engine
from ..engine.intake.media_inputs import MediaIntake
from ..engine.intake.submission import make_submission
from ..engine.intake.validation import per_item
from ..engine.weights.adapter_registry import UNSET, Unset
from ..requests import GenerationOutput, Request
from ..sampling.params import PER_REQUEST_KWARGS

# generate_batch kwargs handed to the Engine as they are.
ENGINE_KWARGS = ("tokenizer", "logits_processor", "assistant_model")


class BatchGenerating(Protocol):
    """A model with the plugin's `generate_batch` method (every `PreTrainedModel` once the plugin is
    installed, plugin.py), as the commands call it."""

    def generate_batch(self, inputs: Sequence[object], **kwargs: object) -> dict[str, GenerationOutput]: ...


def batch_generating(model: PreTrainedModel) -> BatchGenerating:
    """`model` as the plugin made it: `generate_batch` is installed on `PreTrainedModel` at runtime, where
    the type checker does not see it."""
    return cast(BatchGenerating, model)


# Where `generate_batch(persistent_manager=True)` keeps its engine; `model_methods` drops it on request.
CACHED_ENGINE_ATTR = "_transformers_cb_engine"


def generate_batch(
    self: PreTrainedModel,
    inputs: Sequence[Sequence[int]],
    generation_config: GenerationConfig | None = None,
    continuous_batching_config: ContinuousBatchingConfig | None = None,
    record_timestamps: bool = False,
    progress_bar: bool = True,
    persistent_manager: bool = False,
    warmup: bool = True,
    adapter: str | Unset | Sequence[str | None] | None = UNSET,
    **kwargs: Any,
) -> dict[str, GenerationOutput]:
    """Generate for every prompt of `inputs` and block until all are finished or failed.

    Args:
        inputs: token-id lists (or 1D tensors), one per request; or, for a model that takes images /
            videos / audio, a processor's output for one prompt (a dict with `input_ids` and the
            processor's tensors, `pixel_values`, `image_sizes`, `image_grid_thw`, ...; docs/multimodal.md).
        generation_config: sampling/stopping settings (default: the model's); never mutated.
        continuous_batching_config: hardware-side settings, ours or transformers' (converted); never mutated.
        record_timestamps: give each output `timestamps`, one `time.perf_counter()` per generated token.
        progress_bar: show a tqdm bar of finished requests and generated tokens/s.
        persistent_manager: keep the engine (its cache and block tables) on the model, so the next
            call with the same configs reuses it instead of allocating and warming up again.
            `model.destroy_cached_continuous_batching_manager()` releases it.
        warmup: where the run captures CUDA graphs or compiles its forwards, run a throw-away prefill
            and decode step first to do it (transformers' meaning: pre-capture); otherwise nothing to do
            (a warm-up would only move first-call costs earlier, paid once either way).
        adapter: the PEFT adapter to run on, by name, for all inputs or a list with one per input; None:
            the base model (no adapter); not given: the model's active adapter(s) (docs/adapters.md).
        max_new_tokens (kwarg): an int for all requests, or a list with one value per input.
        eos_token_id (kwarg): an int or list of ints overriding the generation config's for all requests.
        tokenizer (kwarg): needed for stop strings (as `generate()` takes one).
        logits_processor (kwarg): the caller's own processors, applied to each request's own history.
        assistant_model (kwarg): a draft model for speculative decoding, as `generate()` takes one (a small
            causal LM with the model's vocabulary; docs/speculative_decoding.md). Its settings
            `num_assistant_tokens`, `num_assistant_tokens_schedule`, `assistant_confidence_threshold` come
            from the generation config or the assistant's own, or per input as kwargs.
        prompt_lookup_num_tokens, max_matching_ngram_size (kwargs): speculative decoding by prompt lookup.
        num_return_sequences (kwarg): sequences per input (default: the generation config's); the
            siblings of input i have ids `"req_<i>__child#<j>"` and share its prompt's KV pages.
        temperature, top_k, top_p, min_p, repetition_penalty, seed, stop_strings, top_logprobs,
            prompt_logprobs (kwargs): per-request parameters, one value for all or a list with one per
            input (see docs/sampling.md; the processor ones need `per_request_processors=True`).
        pixel_values, image_sizes, image_grid_thw, pixel_values_videos, input_features, ... (kwargs): media
            as the model's processor returns them, a list with one value per input (None: none).
        guided (kwarg): the output must match a JSON schema, regex, choice list or grammar: a
            `GuidedDecoding`, a dict such as `{"json": schema}` or a pydantic model class, one for all
            inputs or a list with one per input (None: unconstrained); needs `tokenizer=` and the
            `structured` extra (docs/structured_outputs.md).

    Returns:
        `{request_id: GenerationOutput}` in input order; request ids are `"req_<index>"`, each
        preceded by its forks' `"req_<index>__child#<j>"` (transformers' order) when
        `num_return_sequences > 1`.

    Raises:
        ValueError: naming the input index, for an empty prompt, an out-of-vocabulary token id,
            `max_new_tokens <= 0`, a request longer than the model's context or the whole cache, a bad
            per-request parameter, a guided constraint that does not compile, or a wrong type.
    """
    if isinstance(inputs, (str, bytes)) or not isinstance(inputs, Sequence):
        raise ValueError(f"inputs must be a list of token-id lists, got {type(inputs).__name__}")
    cb_config = take_cb_config(generation_config, continuous_batching_config)
    media_model = MediaIntake.of(self)
    media_kwargs, kwargs = media_model.split(kwargs)
    if media_kwargs and not media_model.takes_media:
        raise ValueError(f"generate_batch: {media_model.refuse_text_only(media_kwargs)}")
    inputs, media = _media_per_input(inputs, media_kwargs)
    unknown = set(kwargs) - {
        "max_new_tokens",
        "eos_token_id",
        "num_return_sequences",
        *ENGINE_KWARGS,
        *PER_REQUEST_KWARGS,
    }
    if unknown:
        raise TypeError(f"generate_batch got unexpected keyword arguments {sorted(unknown)}")
    given_max_new = per_item(kwargs.get("max_new_tokens"), len(inputs), "max_new_tokens")
    eos_ids = [kwargs.get("eos_token_id")] * len(inputs)
    forks = per_item(kwargs.get("num_return_sequences"), len(inputs), "num_return_sequences")
    adapters = per_item(adapter, len(inputs), "adapter")
    per_request = {
        name: per_item(kwargs[name], len(inputs), name, lists_are_values=name == "stop_strings")
        for name in PER_REQUEST_KWARGS
        if name in kwargs
    }
    if not inputs:
        return {}
    # Resolved once, here: the cache's workload needs its defaults before the engine exists, which
    # takes it as it is. Each request's max_new_tokens is defaulted here too, once.
    resolved = ResolvedConfig(resolve_generation_config(self, generation_config))
    max_new = [
        limit if limit is not None else default_max_new_tokens(resolved.config, _num_tokens(ids))
        for ids, limit in zip(inputs, given_max_new, strict=True)
    ]
    workload = _workload(resolved.config, inputs, max_new, forks)
    extras = {name: kwargs.get(name) for name in ENGINE_KWARGS}
    engine = _engine_for(self, resolved, cb_config, workload, persistent_manager, extras)
    requests = [
        engine.build_request(
            make_submission(
                ids,
                f"req_{i}",
                {name: values[i] for name, values in per_request.items()},
                media[i],
                max_new_tokens=max_new[i],
                eos_token_id=eos_ids[i],
                label=f"inputs[{i}]",
                record_timestamps=record_timestamps,
                num_return_sequences=forks[i],
                adapter=adapters[i],
            )
        )
        for i, ids in enumerate(inputs)
    ]
    with engine.session():
        if warmup and engine.warmup_captures and not engine.warmed_up:
            engine.warmup()
        for request in engine.admission_order(requests):
            engine.add(request)
        _run_to_completion(
            engine, [member for request in requests for member in request.family], progress_bar
        )
    # As transformers orders forks: each input's siblings (`__child#i`), then the input's own request.
    return {
        member.request_id: member.to_output()
        for request in requests
        for member in [*request.siblings, request]
    }


def _engine_for(
    model: PreTrainedModel,
    generation_config: ResolvedConfig,
    cb_config: ContinuousBatchingConfig | None,
    workload: list[int],
    persistent: bool,
    extras: dict[str, Any],
) -> Engine:
    """A new engine, or with `persistent` the one cached on the model when it was built from the same
    configs (and the same tokenizer / logits processors) and its cache holds this workload's largest request."""
    if not persistent:
        return build_engine(model, generation_config, cb_config, workload=workload, **extras)
    key = (
        generation_config.config.to_json_string(),
        repr(cb_config if cb_config is not None else ContinuousBatchingConfig()),
        # Identities are safe in the key: the cached engine holds these objects, so ids are not reused.
        id(extras["tokenizer"]),
        tuple(id(p) for p in extras["logits_processor"] or ()),
        id(extras["assistant_model"]),
    )
    cached = getattr(model, CACHED_ENGINE_ATTR, None)
    if cached is not None:
        cached_key, engine = cached
        fits = all(engine.unfittable_reason(n) is None for n in workload)
        if cached_key == key and fits and not engine.has_work():
            engine.reset_counters()
            engine.drop_stale_prefix_cache()  # pages computed with older weights must not be hit
            return engine
    engine = build_engine(model, generation_config, cb_config, workload=workload, **extras)
    setattr(model, CACHED_ENGINE_ATTR, (key, engine))
    return engine


def _media_per_input(
    inputs: Sequence[object], media_kwargs: dict[str, object]
) -> tuple[list[Any], list[dict[str, object]]]:
    """Each input's token ids and media: a processor's output (a dict with `input_ids`) split into both;
    media keyword arguments given one per input (a list) joined to theirs."""
    ids: list[Any] = []  # token ids as given (a list or a 1D tensor), checked by the builder
    media: list[dict[str, object]] = []
    for i, item in enumerate(inputs):
        if isinstance(item, Mapping):
            if "input_ids" not in item:
                raise ValueError(
                    f"inputs[{i}]: a dict input needs input_ids (a processor's output for one prompt)"
                )
            tokens = item["input_ids"]
            if hasattr(tokens, "dim") and tokens.dim() == 2:
                if tokens.shape[0] != 1:
                    raise ValueError(
                        f"inputs[{i}]: input_ids holds {tokens.shape[0]} prompts; give one per input"
                    )
                tokens = tokens[0]
            ids.append(tokens)
            # The prompt's attention mask is all ones for one prompt: the engine attends by construction.
            media.append(
                {name: value for name, value in item.items() if name not in ("input_ids", "attention_mask")}
            )
        else:
            ids.append(item)
            media.append({})
    for name, value in media_kwargs.items():
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{name}: give a list with one value per input (None for an input without it)")
        for i, item_value in enumerate(per_item(value, len(inputs), name)):
            if item_value is not None:
                if name in media[i]:
                    raise ValueError(f"inputs[{i}]: {name} given both in the input and as a keyword argument")
                media[i][name] = item_value
    return ids, media


def _num_tokens(ids: object) -> int:
    return len(ids) if hasattr(ids, "__len__") else 1  # not a list: `Engine.build_request` refuses it


def _workload(
    config: GenerationConfig,
    inputs: Sequence[Sequence[int]],
    max_new: list[int | None],
    forks: list[int | None],
) -> list[int]:
    """Rough max KV length of each request (forks included), to size the cache; `Engine.build_request`
    validates. `config`: the resolved generation config; `max_new`: each request's, defaulted."""
    workload = []
    for ids, limit, num_sequences in zip(inputs, max_new, forks, strict=False):
        length = _num_tokens(ids) + (limit if isinstance(limit, int) and limit > 0 else 1)
        if num_sequences is None:
            num_sequences = config.num_return_sequences or 1
        workload.extend(
            [length] * (num_sequences if isinstance(num_sequences, int) and num_sequences > 0 else 1)
        )
    return workload


def _run_to_completion(engine: Engine, requests: list[Request], progress_bar: bool) -> None:
    start = time.perf_counter()
    with tqdm(total=len(requests), disable=not progress_bar, desc="generate_batch", unit="req") as bar:
        while engine.has_work():
            result = engine.step()
            if result.finished:
                bar.update(len(result.finished))
            elapsed = time.perf_counter() - start
            if progress_bar and elapsed > 0:
                bar.set_postfix(tok_s=f"{engine.counters.generated_tokens / elapsed:.1f}", refresh=False)
