"""With sampling, speculation keeps the target distribution: the tokens of many seeded requests with prompt
lookup are distributed as without it (two-sample chi-square per position, p = 1e-4), on a small-vocabulary
model whose sharpened logits make drafts often accepted, through temperature, top-k and a repetition
penalty (each verified row processed with its own history)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers import GenerationConfig

from tests.sampling.test_distributions import chi_square_critical
from tests.support.models import build_model
from transformers_cb import ContinuousBatchingConfig

# Every step speculates, whatever the batch (the CPU default stops at 8 running requests).
ALWAYS = 10**6

VOCAB = 12
NUM_REQUESTS = 1500
NEW_TOKENS = 4
PROMPT = [3, 11] * 8  # the cycle this model's greedy decoding falls into: drafts are often right


@pytest.fixture(scope="module")
def model():
    model = build_model(
        "llama",
        seed=5,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=VOCAB,
        max_position_embeddings=128,
        attn_implementation="sdpa",
    )
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)
    model.generation_config.eos_token_id = None
    return model


def two_sample_chi_square(a: Counter, b: Counter, n: int) -> tuple[float, int]:
    """Homogeneity of two samples of size `n` each (bins with < 10 in total pooled)."""
    tokens = sorted(set(a) | set(b))
    big = [t for t in tokens if a[t] + b[t] >= 10]
    rows = [(a[t], b[t]) for t in big]
    rest = (n - sum(a[t] for t in big), n - sum(b[t] for t in big))
    if sum(rest):
        rows.append(rest)
    stat = sum((x - y) ** 2 / (x + y) for x, y in rows if x + y)
    return stat, len(rows) - 1


def test_sampled_tokens_are_distributed_as_without_speculation(model) -> None:
    config = GenerationConfig(
        max_new_tokens=NEW_TOKENS, do_sample=True, temperature=0.8, top_k=8, repetition_penalty=1.02
    )
    cb = ContinuousBatchingConfig(speculation_max_batch_size=ALWAYS, seed=11, max_batch_tokens=2048)
    prompts = [PROMPT] * NUM_REQUESTS
    plain = model.generate_batch(prompts, config, continuous_batching_config=cb, progress_bar=False)
    cb = ContinuousBatchingConfig(speculation_max_batch_size=ALWAYS, seed=12, max_batch_tokens=2048)
    spec = model.generate_batch(
        prompts, config, continuous_batching_config=cb, progress_bar=False, prompt_lookup_num_tokens=3
    )
    accepted = sum(o.accepted_draft_tokens for o in spec.values())
    assert accepted > NUM_REQUESTS / 10, f"only {accepted} draft tokens accepted: the test would be weak"
    for position in range(NEW_TOKENS):
        a = Counter(o.generated_tokens[position] for o in plain.values())
        b = Counter(o.generated_tokens[position] for o in spec.values())
        stat, dof = two_sample_chi_square(a, b, NUM_REQUESTS)
        assert stat < chi_square_critical(max(dof, 3)), (position, stat, dof, a, b)


def test_sampled_tokens_with_a_draft_model_are_distributed_as_without_speculation(model) -> None:
    """The same with the model as its own `assistant_model`: its greedy drafts (q one-hot) are accepted with
    the target's probability of each, and the tokens keep the target's distribution."""
    config = GenerationConfig(
        max_new_tokens=NEW_TOKENS,
        do_sample=True,
        temperature=0.8,
        top_k=8,
        num_assistant_tokens=3,
        assistant_confidence_threshold=0.0,
    )
    prompts = [PROMPT] * NUM_REQUESTS
    cb = ContinuousBatchingConfig(speculation_max_batch_size=ALWAYS, seed=13, max_batch_tokens=2048)
    plain = model.generate_batch(prompts, config, continuous_batching_config=cb, progress_bar=False)
    cb = ContinuousBatchingConfig(speculation_max_batch_size=ALWAYS, seed=14, max_batch_tokens=2048)
    spec = model.generate_batch(
        prompts, config, continuous_batching_config=cb, progress_bar=False, assistant_model=model
    )
    accepted = sum(o.accepted_draft_tokens for o in spec.values())
    assert accepted > NUM_REQUESTS / 10, f"only {accepted} draft tokens accepted: the test would be weak"
    for position in range(NEW_TOKENS):
        a = Counter(o.generated_tokens[position] for o in plain.values())
        b = Counter(o.generated_tokens[position] for o in spec.values())
        stat, dof = two_sample_chi_square(a, b, NUM_REQUESTS)
        assert stat < chi_square_critical(max(dof, 3)), (position, stat, dof, a, b)
