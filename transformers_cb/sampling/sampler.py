"""Turning a step's logits into tokens: the processing stages, then argmax or a seeded draw.

Which `GenerationConfig` options may be set at all is decided by config/generation_fields.py's table
(`neutral.check_generation_config`); every processor `generate()` builds for an
implemented option is applied (see processors.py and docs/sampling.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..attention.native.kernel import native_module
from ..invariants import present
from .logits import openai, warpers
from .logits.processors import Stage
from .params import NEUTRAL
from .request_state import RequestSampling, SampledRow, sampling_state
from .structured.grammars import GrammarCompiler

__all__ = ["Sampler", "Samples"]


@dataclass
class Samples:
    """One entry per sampled row, in logits order."""

    tokens: list[int]
    logprobs: list[float | None] | None = None
    top_logprobs: list[dict[int, float] | None] | None = None


def best_tokens(scores: torch.Tensor) -> torch.Tensor:
    """`scores.argmax(dim=-1)`, the same ties (the first best index) and NaN rows. On CPU the native
    library's `best_rows` (attention/native/native_argmax_source.py) where it is loaded, else `max`: torch's
    argmax reduction is ~3x slower than its `max`, and `max` on bf16 rows takes ~480 us for 16 x 32000
    (2 threads) against ~25 us native."""
    if _native_rows(scores):
        module = native_module()
        if module is not None:
            out = torch.empty(scores.shape[0], dtype=torch.long)
            module.best_rows(scores, out)
            return out
    return scores.max(dim=-1).indices


def _native_rows(scores: torch.Tensor) -> bool:
    return (
        scores.device.type == "cpu"
        and scores.dim() == 2
        and scores.dtype in (torch.float32, torch.bfloat16)
        and scores.shape[1] > 0
        and scores.stride(1) == 1
        and not (scores.requires_grad and torch.is_grad_enabled())
    )


class Sampler:
    """Samples one token per row of `[S, vocab]` logits with each row's request state.

    Args:
        stages: the processing pipeline (processors.build_stages).
        do_sample: the engine's default (each request's `params.do_sample` decides for its row):
            draw from the processed distribution; otherwise argmax.
        grammars: masks the rows of guided requests (their `sampling.grammar`), before any stage.

    A row whose request has no state (`sampling is None`: greedy, nothing changes its logits) is
    passed through every stage unchanged and takes the argmax.
    """

    def __init__(
        self,
        stages: list[Stage],
        do_sample: bool,
        device: torch.device,
        grammars: GrammarCompiler | None = None,
    ) -> None:
        self.stages = stages
        self.do_sample = do_sample
        self.device = device
        self.grammars = grammars
        self._row_index = {id(stage): i for i, stage in enumerate(s for s in stages if s.kind == "row")}

    def sample(self, logits: torch.Tensor, requests: Sequence[SampledRow]) -> Samples:
        """Args: logits `[S, vocab]` of any float dtype (the model's: widened to float32 here where needed);
        `requests[i]` owns row i (`.sampling`, `.all_token_ids`)."""
        states: list[RequestSampling | None] = [sampling_state(request) for request in requests]
        if all(state is None for state in states):
            # Greedy without processors or outputs: the hot path, one argmax, on the logits as they are
            # (bf16 -> float32 is exact: the same best index and ties as on the widened copy).
            return Samples(tokens=best_tokens(logits).tolist())
        scores = self.scores(logits.float(), requests)
        sampled = [
            (i, state) for i, state in enumerate(states) if state is not None and state.params.do_sample
        ]
        sampled_states = [state for _, state in sampled]
        if len(sampled) == len(states):
            tokens = self._draw(scores, sampled_states)
        else:
            tokens = best_tokens(scores)
            if sampled:
                rows = torch.tensor([i for i, _ in sampled], dtype=torch.long, device=scores.device)
                tokens[rows] = self._draw(scores[rows], sampled_states)
        return self._outputs(scores, tokens, states)

    def scores(self, logits: torch.Tensor, requests: Sequence[SampledRow]) -> torch.Tensor:
        """The processed scores of each row (guided rows masked first, in place), before any draw."""
        self._mask(logits, requests, [sampling_state(request) for request in requests])
        return self.process(logits, requests)

    def _mask(
        self, logits: torch.Tensor, requests: Sequence[SampledRow], states: list[RequestSampling | None]
    ) -> None:
        """Guided rows: only the tokens their grammar allows next (in place, those rows only). As vLLM
        does, before the processors: top-k / top-p then choose among allowed tokens."""
        guided = [
            (i, state.grammar)
            for i, state in enumerate(states)
            if state is not None and state.grammar is not None
        ]
        if not guided:
            return
        rows = [i for i, _ in guided]
        grammar_states = []
        for i, grammar in guided:
            grammar.sync(requests[i].generated_ids)
            grammar_states.append(grammar)
        compiler = present(self.grammars, "guided requests without a grammar compiler")
        compiler.apply_masks(logits, rows, grammar_states)

    def process(self, logits: torch.Tensor, requests: Sequence[SampledRow]) -> torch.Tensor:
        """The scores `generate()` would sample from for each row (its processed `scores`)."""
        scores = logits
        states: list[RequestSampling | None] = [sampling_state(request) for request in requests]
        for stage in self.stages:
            if stage.kind == "vector":
                scores = self._vector(stage.name, scores, requests, states)
            elif stage.kind == "shared":
                no_ids = torch.empty(scores.shape[0], 0, dtype=torch.long, device=scores.device)
                scores = present(stage.processor, "shared stages carry their processor")(no_ids, scores)
            elif stage.kind == "openai":
                scores = openai.apply(scores, requests, states)
            else:
                scores = self._rows(stage, scores, requests, states)
        return scores

    def _vector(
        self, name: str, scores: torch.Tensor, requests: Sequence[SampledRow], states: list
    ) -> torch.Tensor:
        values = [getattr(NEUTRAL if state is None else state.params, name) for state in states]
        if all(v == getattr(NEUTRAL, name) for v in values):
            return scores
        if name == "repetition_penalty":
            vocab = scores.shape[-1]
            none = torch.zeros(vocab, dtype=torch.bool, device=scores.device)
            seen = torch.stack(
                [
                    none if state is None else state.seen(r.all_token_ids, vocab, scores.device)
                    for state, r in zip(states, requests, strict=True)
                ]
            )
            return warpers.repetition_penalty(scores, seen, values)
        return getattr(warpers, name)(scores, values)

    def _rows(
        self, stage: Stage, scores: torch.Tensor, requests: Sequence[SampledRow], states: list
    ) -> torch.Tensor:
        """A history-dependent processor: each row with its own request's tokens, as a batch of one."""
        index = self._row_index[id(stage)]
        rows = []
        for i, (state, request) in enumerate(zip(states, requests, strict=True)):
            processor = None if state is None else state.row_processors[index]
            row = scores[i : i + 1]
            if processor is not None:
                capacity = request.num_prompt_tokens + request.max_new_tokens
                row = processor(state.history(request.all_token_ids, capacity, scores.device), row)
            rows.append(row)
        return torch.cat(rows)

    def _draw(self, scores: torch.Tensor, states: list[RequestSampling]) -> torch.Tensor:
        """One token per row: argmax(p / E) with E ~ Exp(1) is an exact draw from p (exponential race).

        A row with a generator fills its noise from it alone, so its token depends only on its
        own probabilities and stream, not on the other rows."""
        probs = scores.softmax(dim=-1)
        noise = torch.empty_like(probs)
        seeded = [i for i, state in enumerate(states) if state.generator is not None]
        if len(seeded) < len(states):
            noise.exponential_()
        for i in seeded:
            noise[i].exponential_(generator=states[i].generator)
        # An exponential sample of exactly 0 would make 0/0 = nan win the argmax.
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)
        return (probs / noise).argmax(dim=-1)

    def _outputs(
        self, scores: torch.Tensor, tokens: torch.Tensor, states: list[RequestSampling | None]
    ) -> Samples:
        token_list = tokens.tolist()
        wants = [state is not None and state.params.return_logprobs for state in states]
        if not any(wants):
            return Samples(tokens=token_list)
        logprobs = scores.log_softmax(dim=-1)
        chosen = logprobs.gather(1, tokens[:, None]).squeeze(1).tolist()
        samples = Samples(
            tokens=token_list, logprobs=[lp if w else None for lp, w in zip(chosen, wants, strict=True)]
        )
        ks = [state.params.top_logprobs if state is not None else 0 for state in states]
        if max(ks) > 0:
            top = logprobs.topk(min(max(ks), logprobs.shape[-1]), dim=-1)
            values, indices = top.values.tolist(), top.indices.tolist()
            samples.top_logprobs = [
                dict(zip(indices[i][:k], values[i][:k], strict=True)) if k else None for i, k in enumerate(ks)
            ]
        return samples
