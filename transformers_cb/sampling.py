"""Turning a step's logits into tokens: greedy, or temperature / top-k / top-p sampling.

Which `GenerationConfig` options may be set at all is decided in one table,
`generation_fields.py` (`check_generation_config`, re-exported here).
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from .generation_fields import check_generation_config

__all__ = ["Sampler", "check_generation_config"]


PER_REQUEST_PARAMETERS = ("temperature", "top_k", "top_p")


def check_processor_kwargs(kwargs: dict) -> None:
    """Per-request sampling parameters of `add_request(**logit_processor_kwargs)`."""
    unknown = sorted(set(kwargs) - set(PER_REQUEST_PARAMETERS))
    if unknown:
        raise TypeError(f"add_request got unexpected keyword arguments {unknown}")
    given = sorted(name for name, value in kwargs.items() if value is not None)
    if given:
        raise NotImplementedError(
            f"per-request {', '.join(given)} need per_request_processors (not built yet)"
        )


class Sampler:
    """Samples one token per row of `[S, vocab]` logits, with the config's processors."""

    def __init__(self, config: GenerationConfig, seed: int | None, device: torch.device) -> None:
        self.do_sample = bool(config.do_sample)
        self.processors = LogitsProcessorList()
        if self.do_sample:
            if config.temperature is not None and config.temperature != 1.0:
                self.processors.append(TemperatureLogitsWarper(config.temperature))
            if config.top_k is not None and config.top_k != 0:
                self.processors.append(TopKLogitsWarper(config.top_k))
            if config.top_p is not None and config.top_p < 1.0:
                self.processors.append(TopPLogitsWarper(config.top_p))
        self.generator = None
        if seed is not None:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(seed)

    def sample(self, logits: torch.Tensor, with_logprobs: bool) -> tuple[list[int], list[float] | None]:
        """Args: logits `[S, vocab]` float32. Returns S token ids and, if asked, their log-probabilities."""
        scores = self.processors(None, logits) if len(self.processors) else logits
        if self.do_sample:
            probs = scores.softmax(dim=-1)
            tokens = torch.multinomial(probs, num_samples=1, generator=self.generator).squeeze(1)
        else:
            tokens = scores.argmax(dim=-1)
        logprobs = None
        if with_logprobs:
            logprobs = scores.log_softmax(dim=-1).gather(1, tokens[:, None]).squeeze(1).tolist()
        return tokens.tolist(), logprobs
