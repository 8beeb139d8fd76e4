"""Every logits processor `generate()` builds, one test each, plus a combination: greedy tokens
equal `generate()` run on each prompt alone, and each token's logprob equals `log_softmax` of the
processed scores `generate(output_scores=True)` returns.

History-dependent processors must see exactly the request's own prompt + generated tokens; the
settings chunk the prefill (budget 16, pages of 4) and, for the combination, evict and recompute.
Each case first checks that the processor changes plain greedy output, so a processor that is
silently dropped fails the test.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, PreTrainedModel

from conformance.common import tight_num_blocks
from tests.support.models import build_tiny_model, vocab_size
from tests.support.prompts import prompts_of_lengths
from transformers_cb import ContinuousBatchingConfig

MAX_NEW_TOKENS = 8
LENGTHS = (1, 3, 7, 10, 21)


class NoEchoProcessor(LogitsProcessor):
    """A user processor that reads the history: bans the previous token, favours (sum of ids) % 7."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        rows = torch.arange(scores.shape[0])
        scores[rows, input_ids[:, -1]] = -float("inf")
        scores[rows, input_ids.sum(dim=-1) % 7 + 3] += 2.0
        return scores


@pytest.fixture(scope="module")
def model() -> PreTrainedModel:
    return build_tiny_model("llama", seed=3, attn_implementation="paged|sdpa")


@pytest.fixture(scope="module")
def prompts(model) -> list[list[int]]:
    prompts = prompts_of_lengths(LENGTHS, vocab_size(model), seed=11)
    prompts[3] = [9, 10, 9, 10, 9, 10, 9, 10, 9, 10]  # repeats, for the history-dependent processors
    return prompts


@torch.inference_mode()
def reference(
    model: PreTrainedModel, prompt: list[int], config: GenerationConfig, processors: list | None = None
) -> tuple[list[int], list[float]]:
    """`generate()` on `prompt` alone: its tokens and the logprob of each under its processed scores."""
    input_ids = torch.tensor([prompt])
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        generation_config=config,
        logits_processor=LogitsProcessorList(processors or []),
        output_scores=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [float(s.log_softmax(-1)[0, t]) for s, t in zip(out.scores, tokens, strict=True)]
    return tokens, logprobs


def plain_first_tokens(model, prompts) -> list[int]:
    config = GenerationConfig(max_new_tokens=3, do_sample=False, eos_token_id=None)
    return reference(model, prompts[0], config)[0] + reference(model, prompts[2], config)[0]


# name -> (GenerationConfig kwargs from a few greedy tokens `t`, user processors)
CASES: dict[str, Callable[[list[int]], tuple[dict, list]]] = {
    "sequence_bias": lambda t: ({"sequence_bias": {(t[0],): -30.0, (t[3], t[4]): -30.0}}, []),
    "repetition_penalty": lambda t: ({"repetition_penalty": 3.0}, []),
    "encoder_repetition_penalty": lambda t: ({"encoder_repetition_penalty": 4.0}, []),
    "no_repeat_ngram_size": lambda t: ({"no_repeat_ngram_size": 1}, []),
    "encoder_no_repeat_ngram_size": lambda t: ({"encoder_no_repeat_ngram_size": 1}, []),
    "bad_words_ids": lambda t: ({"bad_words_ids": [[t[0]], [t[3], t[4]]]}, []),
    "min_length": lambda t: ({"min_length": 12, "eos_token_id": t[0]}, []),
    "min_new_tokens": lambda t: ({"min_new_tokens": 3, "eos_token_id": [t[0], t[3]]}, []),
    "forced_bos_token_id": lambda t: ({"forced_bos_token_id": 5}, []),
    "forced_eos_token_id": lambda t: ({"forced_eos_token_id": 7}, []),
    "exponential_decay_length_penalty": lambda t: (
        {"exponential_decay_length_penalty": (2, 3.0), "eos_token_id": 4},
        [],
    ),
    "suppress_tokens": lambda t: ({"suppress_tokens": [t[0], t[3]]}, []),
    "begin_suppress_tokens": lambda t: ({"begin_suppress_tokens": [t[0], t[3]]}, []),
    "user_logits_processor": lambda t: ({}, [NoEchoProcessor()]),
    "combination": lambda t: (
        {
            "repetition_penalty": 1.5,
            "no_repeat_ngram_size": 2,
            "min_new_tokens": 2,
            "eos_token_id": t[0],
            "sequence_bias": {(t[3],): -5.0},
            "suppress_tokens": [t[4]],
        },
        [NoEchoProcessor()],
    ),
}
# Processors that cannot change greedy tokens (they keep the argmax), checked on logprobs only.
ARGMAX_PRESERVING = {
    "remove_invalid_values": {"remove_invalid_values": True},
    "renormalize_logits": {"renormalize_logits": True},
}


def _check(model, prompts, kwargs: dict, processors: list, **cb_kwargs) -> list[list[int]]:
    config = GenerationConfig(
        max_new_tokens=MAX_NEW_TOKENS, do_sample=False, **{"eos_token_id": None, **kwargs}
    )
    cb = ContinuousBatchingConfig(page_size=4, max_batch_tokens=16, return_logprobs=True, **cb_kwargs)
    outputs = model.generate_batch(prompts, config, cb, progress_bar=False, logits_processor=processors)
    references = []
    for i, prompt in enumerate(prompts):
        tokens, logprobs = reference(model, prompt, config, processors)
        output = outputs[f"req_{i}"]
        assert output.generated_tokens == tokens, f"req_{i} ({len(prompt)} prompt tokens)"
        assert output.logprobs == pytest.approx(logprobs, abs=1e-4), f"req_{i}"
        references.append(tokens)
    return references


# min_length counts the prompt: short prompts cannot reach it, which generate() warns about.
@pytest.mark.filterwarnings("ignore:Unfeasible length constraints")
@pytest.mark.parametrize("name", sorted(CASES))
def test_greedy_with_processor_equals_generate(model, prompts, name: str) -> None:
    kwargs, processors = CASES[name](plain_first_tokens(model, prompts))
    references = _check(model, prompts, kwargs, processors)
    plain = GenerationConfig(max_new_tokens=MAX_NEW_TOKENS, do_sample=False, eos_token_id=None)
    assert any(reference(model, p, plain)[0] != r for p, r in zip(prompts, references, strict=True)), (
        f"{name} does not change greedy output on these prompts: the test would not catch a dropped processor"
    )


@pytest.mark.parametrize("name", sorted(ARGMAX_PRESERVING))
def test_argmax_preserving_processor_logprobs(model, prompts, name: str) -> None:
    _check(model, prompts, ARGMAX_PRESERVING[name], [])


def test_combination_survives_eviction_and_recompute(model, prompts) -> None:
    kwargs, processors = CASES["combination"](plain_first_tokens(model, prompts))
    num_blocks = tight_num_blocks(prompts, MAX_NEW_TOKENS, page_size=4)
    _check(model, prompts, kwargs, processors, num_blocks=num_blocks)
