"""Guided decoding: greedy constrained tokens equal `generate()` with llguidance's constraint as a logits
processor on each prompt alone, for a JSON schema, a regex, a choice and a grammar, in one batch that chunks
its prefills and preempts.

The reference processor is written here on llguidance's own API (a matcher per `generate()` call, its
byte-per-token `compute_logit_bias` mask), independent of the engine's batched bitmask; `generate()`
stops where the grammar ends (a stopping criterion on the matcher), as the engine does.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import GenerationConfig, LogitsProcessor, StoppingCriteria

from tests.support.preemptions import count_preemptions
from transformers_cb import ContinuousBatchingConfig, GuidedDecoding
from transformers_cb.models.tiny import build_tiny_model, build_tiny_tokenizer
from transformers_cb.sampling.structured.grammars import JSON_OPTIONS

llguidance = pytest.importorskip("llguidance")
llguidance_hf = pytest.importorskip("llguidance.hf")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "n": {"type": "integer", "minimum": -5, "maximum": 500},
        "xs": {"type": "array", "items": {"enum": ["p", "q"]}, "maxItems": 3},
    },
    "required": ["name", "n", "xs"],
}
CASES = {
    "json": (
        GuidedDecoding(json=SCHEMA),
        llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults=JSON_OPTIONS),
    ),
    "regex": (
        GuidedDecoding(regex=r"(ab|cd)+\d{2,4}"),
        llguidance.LLMatcher.grammar_from_regex(r"(ab|cd)+\d{2,4}"),
    ),
    "choice": (
        GuidedDecoding(choice=("red", "green", "blue")),
        llguidance.grammar_from("choice", '["red", "green", "blue"]'),
    ),
    "grammar": (
        GuidedDecoding(grammar='root ::= "[" item ("," item)* "]"\nitem ::= [a-z] [0-9]?'),
        llguidance.grammar_from("grammar", 'root ::= "[" item ("," item)* "]"\nitem ::= [a-z] [0-9]?'),
    ),
}
MAX_NEW_TOKENS = 96


class GrammarProcessor(LogitsProcessor):
    """llguidance's constraint for one `generate()` call (batch of one): tokens past the prompt feed the matcher."""

    def __init__(self, matcher, prompt_length: int) -> None:
        self.matcher = matcher
        self.prompt_length = prompt_length
        self.fed = 0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        generated = input_ids[0, self.prompt_length :].tolist()
        assert self.matcher.consume_tokens(generated[self.fed :]), self.matcher.get_error()
        self.fed = len(generated)
        bias = torch.frombuffer(bytearray(self.matcher.compute_logit_bias()), dtype=torch.uint8)
        allowed = torch.zeros(scores.shape[-1], dtype=torch.bool)
        allowed[: bias.numel()] = bias[: scores.shape[-1]] > 0
        return scores.masked_fill(~allowed, float("-inf"))


class GrammarEnded(StoppingCriteria):
    def __init__(self, matcher, prompt_length: int) -> None:
        self.matcher = matcher
        self.prompt_length = prompt_length

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        probe = self.matcher.deep_copy()
        probe.reset()
        probe.consume_tokens(input_ids[0, self.prompt_length :].tolist())
        return torch.tensor([probe.is_stopped()])


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return build_tiny_model(seed=7, attn_implementation="paged|sdpa", tokenizer=tokenizer)


@torch.inference_mode()
def reference(model, tokenizer, prompt: list[int], grammar: str) -> list[int]:
    lltokenizer = llguidance_hf.from_tokenizer(tokenizer, n_vocab=model.config.vocab_size)
    matcher = llguidance.LLMatcher(lltokenizer, grammar, log_level=0)
    input_ids = torch.tensor([prompt])
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        generation_config=GenerationConfig(
            do_sample=False, max_new_tokens=MAX_NEW_TOKENS, eos_token_id=tokenizer.eos_token_id
        ),
        logits_processor=[GrammarProcessor(matcher, len(prompt))],
        stopping_criteria=[GrammarEnded(matcher, len(prompt))],
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize(
    "cb",
    [{}, {"page_size": 4, "max_batch_tokens": 16, "num_blocks": 30}],
    ids=["roomy", "chunked-preempted"],
)
def test_greedy_guided_equals_generate_with_the_librarys_processor(model, tokenizer, cb) -> None:
    names = list(CASES) * 2
    prompts = [tokenizer.encode(f"{name} #{i}, go: ") for i, name in enumerate(names)]
    with count_preemptions() as preempted:
        outputs = model.generate_batch(
            prompts,
            GenerationConfig(
                do_sample=False, max_new_tokens=MAX_NEW_TOKENS, eos_token_id=tokenizer.eos_token_id
            ),
            ContinuousBatchingConfig(**cb),
            progress_bar=False,
            tokenizer=tokenizer,
            guided=[CASES[name][0] for name in names],
        )
    assert bool(preempted) == ("num_blocks" in cb)
    for (request_id, output), name, prompt in zip(outputs.items(), names, prompts, strict=True):
        expected = reference(model, tokenizer, prompt, CASES[name][1])
        assert output.generated_tokens == expected, (request_id, name, tokenizer.decode(expected))
    texts = [tokenizer.decode(o.generated_tokens, skip_special_tokens=True) for o in outputs.values()]
    assert list(outputs.values())[0].finish_reason == "stop"
    json.loads(texts[0])  # the schema's output is JSON (validated in tests/sampling/test_guided.py)
