"""Sampling is correct, not only reproducible: for each warper, the empirical frequencies of many
seeded draws at one position match the probabilities of `generate()`'s processed scores
(chi-square goodness of fit). The seeds are fixed, so each test is deterministic; the critical
value is at p = 1e-4, so a correct sampler fails with probability 1e-4 for a new seed."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from transformers import GenerationConfig

from tests.support.models import tiny_llama
from transformers_cb import ContinuousBatchingConfig

NUM_DRAWS = 2000
PROMPT = [7, 42, 19, 250, 3]
MIN_EXPECTED = 5.0  # bins below this expected count are pooled
Z_1E4 = 3.719  # upper 1e-4 quantile of the standard normal


@pytest.fixture(scope="module")
def model():
    """A random model with sharper logits than the flat ones random weights give, so the warpers
    cut real mass and a wrong distribution is far from the right one."""
    model = tiny_llama("paged|sdpa", seed=21)
    with torch.no_grad():
        model.lm_head.weight.mul_(12.0)
    return model


def chi_square_critical(dof: int, z: float = Z_1E4) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (good to ~1% for dof >= 3)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def chi_square(counts: Counter, probs: torch.Tensor, draws: int) -> tuple[float, int]:
    """(statistic, degrees of freedom) with low-expectation bins pooled into one."""
    expected = probs * draws
    big = (expected >= MIN_EXPECTED).nonzero().flatten().tolist()
    observed = [counts.get(t, 0) for t in big]
    wanted = [float(expected[t]) for t in big]
    pooled_expected = draws - sum(wanted)
    if pooled_expected > 1e-9:
        observed.append(draws - sum(observed))
        wanted.append(pooled_expected)
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, wanted, strict=True))
    return stat, len(wanted) - 1


WARPERS = {
    "temperature": {"temperature": 0.6, "top_k": 0},
    "top_k": {"top_k": 12},
    "top_p": {"top_p": 0.5, "top_k": 0},
    "min_p": {"min_p": 0.1, "top_k": 0},
}


def first_step_scores(model, config: GenerationConfig) -> torch.Tensor:
    """The processed scores `generate(output_scores=True)` samples PROMPT's first new token from."""
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        output = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            generation_config=config,
            output_scores=True,
            return_dict_in_generate=True,
        )
    return output.scores[0][0]


@pytest.mark.parametrize("name", sorted(WARPERS))
def test_empirical_frequencies_match_generate_probabilities(model, name: str) -> None:
    config = GenerationConfig(max_new_tokens=1, do_sample=True, eos_token_id=None, **WARPERS[name])
    probs = first_step_scores(model, config).float().softmax(-1)
    cb = ContinuousBatchingConfig(seed=20261201, page_size=16)
    outputs = model.generate_batch([PROMPT] * NUM_DRAWS, config, cb, progress_bar=False)
    counts = Counter(out.generated_tokens[0] for out in outputs.values())
    impossible = {t: c for t, c in counts.items() if probs[t] == 0}
    assert not impossible, f"{name}: drew tokens the processed scores exclude: {impossible}"
    stat, dof = chi_square(counts, probs, NUM_DRAWS)
    assert dof >= 3, f"{name}: too few bins for the test ({dof + 1})"
    assert stat < chi_square_critical(dof), f"{name}: chi-square {stat:.1f} with {dof} dof"


def test_chi_square_detects_a_wrong_distribution(model) -> None:
    """The statistic rejects draws from a distribution at a different temperature (the test can fail)."""
    config = GenerationConfig(max_new_tokens=1, do_sample=True, eos_token_id=None, temperature=0.6, top_k=0)
    logits = first_step_scores(model, config)
    wrong = GenerationConfig(max_new_tokens=1, do_sample=True, eos_token_id=None, temperature=0.9, top_k=0)
    cb = ContinuousBatchingConfig(seed=20261201, page_size=16)
    outputs = model.generate_batch([PROMPT] * NUM_DRAWS, wrong, cb, progress_bar=False)
    counts = Counter(out.generated_tokens[0] for out in outputs.values())
    stat, dof = chi_square(counts, logits.float().softmax(-1), NUM_DRAWS)
    assert stat > chi_square_critical(dof)
