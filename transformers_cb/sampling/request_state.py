"""Per-request sampling state, and `SamplingSetup`, which builds it at submission.

A request that needs nothing beyond greedy argmax (no processor changes its row, no logprobs, no
stop string) gets no state at all (`request.sampling is None`), so the greedy path stays a single
argmax, also in an engine where other requests sample.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol, cast

import torch
from transformers import GenerationConfig, PreTrainedTokenizerBase
from transformers.generation.logits_process import LogitsProcessor
from transformers.generation.stopping_criteria import StopStringCriteria

from ..invariants import present
from ..requests import Request, SamplingState
from .logits.processors import RowContext, Stage, build_stages
from .neutral import NEUTRAL_VALUES
from .params import (
    VECTOR_PARAMS,
    SamplingParams,
    check_config_values,
    default_params,
    derive_seed,
    resolve_request_params,
)
from .stop_strings import StopStrings, hits_stop_string
from .structured.grammars import GrammarCompiler, GrammarState


@dataclass(eq=False)
class RequestSampling:
    """What the sampler keeps for one request between steps.

    `generator` is the request's own random stream: every token it samples draws from it and
    from nothing else, so its tokens do not depend on the rest of the batch (docs/sampling.md).
    """

    params: SamplingParams
    row_processors: list[LogitsProcessor | None]  # one per row stage, None where inactive
    generator: torch.Generator | None = None
    stop: StopStringCriteria | None = None
    grammar: GrammarState | None = None  # guided decoding (grammars.py)
    _history: torch.Tensor | None = field(default=None, repr=False)  # [1, capacity]
    _filled: int = 0
    _seen: torch.Tensor | None = field(default=None, repr=False)  # [vocab] bool
    _seen_upto: int = 0
    _counts: torch.Tensor | None = field(default=None, repr=False)  # [vocab] float: generated tokens
    _counted: int = 0

    def history(self, token_ids: list[int], capacity: int, device: torch.device) -> torch.Tensor:
        """`[1, len(token_ids)]` prompt + generated ids, appended to incrementally (tokens never change)."""
        if self._history is None or self._history.shape[1] < len(token_ids):
            grown = torch.empty(1, max(capacity, len(token_ids)), dtype=torch.long, device=device)
            if self._history is not None:
                grown[:, : self._filled] = self._history[:, : self._filled]
            self._history = grown
        if self._filled < len(token_ids):
            new = torch.tensor(token_ids[self._filled :], dtype=torch.long)
            self._history[0, self._filled : len(token_ids)] = new.to(device)
            self._filled = len(token_ids)
        return self._history[:, : len(token_ids)]

    def seen(self, token_ids: list[int], vocab_size: int, device: torch.device) -> torch.Tensor:
        """`[vocab]` bool: which tokens occur in prompt + generated (for the repetition penalty)."""
        if self._seen is None:
            self._seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        if self._seen_upto < len(token_ids):
            new = torch.tensor(token_ids[self._seen_upto :], dtype=torch.long).clamp_(max=vocab_size - 1)
            self._seen[new.to(device)] = True
            self._seen_upto = len(token_ids)
        return self._seen

    def generated_counts(self, generated: list[int], vocab_size: int, device: torch.device) -> torch.Tensor:
        """`[vocab]` float32: how often each token was generated so far (OpenAI's penalties count only
        the completion, not the prompt)."""
        if self._counts is None:
            self._counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        if self._counted < len(generated):
            new = torch.tensor(generated[self._counted :], dtype=torch.long).clamp_(max=vocab_size - 1)
            self._counts.index_add_(0, new.to(device), torch.ones(len(new), device=device))
            self._counted = len(generated)
        return self._counts

    def rollback(self, num_tokens: int, num_generated: int) -> None:
        """Forget what the caches hold past the first `num_tokens` tokens (`num_generated` generated):
        speculation fed them draft tokens that were rejected (sampling/verification.py)."""
        self._filled = min(self._filled, num_tokens)
        if self._seen_upto > num_tokens:  # a set cannot forget one occurrence: rebuilt on next use
            self._seen, self._seen_upto = None, 0
        if self._counted > num_generated:
            self._counts, self._counted = None, 0
        if self.grammar is not None:
            self.grammar.rollback(num_generated)

    def hits_stop_string(self, token_ids: list[int]) -> bool:
        return self.stop is not None and hits_stop_string(self.stop, token_ids)

    def grammar_finished(self, generated_ids: list[int]) -> bool:
        """The request's constraint has reached its end (nothing but eos may follow)."""
        return self.grammar is not None and self.grammar.finished(generated_ids)


class SampledRow(Protocol):
    """A row the sampler processes: a `Request`, or a speculating request at one draft depth
    (`verification.DraftView`); what the stages read of it."""

    @property
    def sampling(self) -> SamplingState | None: ...

    @property
    def all_token_ids(self) -> list[int]: ...

    @property
    def generated_ids(self) -> list[int]: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def max_new_tokens(self) -> int: ...

    @property
    def eos_token_ids(self) -> frozenset[int]: ...


def sampling_state(row: SampledRow) -> RequestSampling | None:
    """The sampling state of a request (or a row of it), as this room made it: `Request` knows it only by
    the protocol it calls (`requests.SamplingState`), and `SamplingSetup.attach` is its one writer."""
    return cast(RequestSampling | None, row.sampling)


class SamplingSetup:
    """Args:
    config: the resolved GenerationConfig (defaults of every request).
    per_request_processors / return_logprobs / top_logprobs / prompt_logprobs / seed: from the
        ContinuousBatchingConfig.
    tokenizer: needed only for stop strings and guided decoding.
    vocab_size: the width of the model's logits (guided decoding's masks).
    user_processors: the caller's `logits_processor` list, applied to each request's own history.
    all_request_stages: build every per-request processor stage (the vectorized ones and OpenAI's)
        whatever `config`'s values, with neutral defaults: each request brings its own values (the
        server's engine; otherwise transformers' rule holds, a processor exists only when the
        GenerationConfig sets it away from neutral).
    """

    def __init__(
        self,
        config: GenerationConfig,
        device: torch.device,
        *,
        per_request_processors: bool = False,
        return_logprobs: bool = False,
        top_logprobs: int = 0,
        prompt_logprobs: bool = False,
        seed: int | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        user_processors: Sequence[LogitsProcessor] = (),
        vocab_size: int | None = None,
        all_request_stages: bool = False,
    ) -> None:
        self.config = config
        self.all_request_stages = all_request_stages
        self.device = device
        self.per_request_processors = per_request_processors
        self.seed = seed
        self.do_sample = bool(config.do_sample)
        self.stages: list[Stage] = build_stages(
            config,
            user_processors,
            openai=per_request_processors or all_request_stages,
            all_request_stages=all_request_stages,
        )
        self.row_stages = [stage for stage in self.stages if stage.kind == "row"]
        # Shared and row stages may change any row: every request keeps state when one exists.
        # Vector and OpenAI stages change only rows with non-neutral values (`changes_logits`).
        self.has_fixed_stages = any(stage.kind in ("shared", "row") for stage in self.stages)
        self.base = default_params(config, return_logprobs, top_logprobs, prompt_logprobs, all_request_stages)
        check_config_values(self.base, config)
        self.stop_strings = StopStrings(tokenizer)
        self.stop_strings.check_available(self.base.stop_strings, "GenerationConfig.stop_strings")
        eos = config.eos_token_id
        eos_ids = [eos] if isinstance(eos, int) else list(eos or ())
        self.grammars = GrammarCompiler(tokenizer, vocab_size or 0, eos_ids)

    def clear_stages(self) -> None:
        """No processing stage any more; requests attached later get neutral processor values."""
        self.stages, self.row_stages, self.has_fixed_stages = [], [], False
        self.base = replace(self.base, **{name: NEUTRAL_VALUES[name] for name in VECTOR_PARAMS})

    def attach(
        self,
        request: Request,
        kwargs: Mapping[str, object] | None = None,
        label: str | None = None,
    ) -> None:
        """Validate `kwargs` (per-request parameters) and give `request` its sampling state.

        Raises `ValueError` naming `label` (see `params.resolve_request_params`)."""
        label = label or f"request {request.request_id!r}"
        params = resolve_request_params(
            self.base,
            kwargs or {},
            self.config,
            self.per_request_processors,
            label,
            self.all_request_stages,
        )
        self.stop_strings.check_available(params.stop_strings, label)
        needs_state = (
            self.has_fixed_stages
            or params.do_sample
            or params.changes_logits
            or params.return_logprobs
            or params.prompt_logprobs
            or bool(params.stop_strings)
            or params.guided is not None
        )
        if not needs_state:
            request.sampling = None
            return
        context = RowContext(
            prompt_ids=request.prompt_ids,
            eos_token_ids=tuple(sorted(request.eos_token_ids)),
            max_new_tokens=request.max_new_tokens,
            device=self.device,
        )
        generator = None
        if params.do_sample and (params.seed is not None or self.seed is not None):
            seed = (
                params.seed
                if params.seed is not None
                else derive_seed(present(self.seed), request.request_id)
            )
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed)
        request.sampling = RequestSampling(
            params=params,
            row_processors=[
                present(stage.factory, "row stages carry their factory")(context) for stage in self.row_stages
            ],
            generator=generator,
            stop=self.stop_strings.criteria(params.stop_strings) if params.stop_strings else None,
            grammar=self.grammars.state(params.guided, label) if params.guided is not None else None,
        )
