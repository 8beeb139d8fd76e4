"""Speculative decoding by prompt lookup is exact: greedy outputs equal `generate()` token for token and
equal the same requests without speculation, on the full-attention, sliding, hybrid and chunked (Llama 4)
families, with a
roomy cache, under preemption (a cache of about a quarter of the working set, chunked prefill mixing
prefill chunks with verification rows), and with forks; eos and `max_new_tokens` cut a verified run
exactly where plain decoding stops. The prompts repeat a pattern and random models repeat themselves, so
drafts are accepted: every test checks that some were (it cannot pass vacuously). The engine's integrity
check (pages, prefix keys, block tables) runs after every step, and every page is back at the end.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

import pytest
import torch
from transformers import GenerationConfig

from conformance.common import ReferenceCache, check_parity, count_preemptions, greedy_config
from conformance.test_parity_offload import pressure_num_blocks
from tests.support.models import backends_for, build_tiny_model, using_backend, vocab_size
from tests.support.prompts import random_prompts
from transformers_cb import ContinuousBatchingConfig
from transformers_cb.engine.engine import Engine
from transformers_cb.models.tiny import build_tiny_model as build_tiny_model_with_tokenizer
from transformers_cb.models.tiny import build_tiny_tokenizer
from transformers_cb.scheduler.scheduler import Scheduler

# Every step speculates, whatever the batch (the CPU default stops at 8 running requests).
ALWAYS = 10**6

MAX_NEW_TOKENS = 24
LOOKUP = 4
FAMILIES = ("llama", "mistral", "gemma3", "llama4")  # full; sliding; hybrid (sliding + full); chunked + full


def repeating_prompts(model, count: int = 6, seed: int = 2) -> list[list[int]]:
    """Prompts that repeat a short random pattern (2-4 times) after a random head: lookup finds drafts."""
    vocab = vocab_size(model)
    heads = random_prompts(count, vocab, 1, 8, seed=seed)
    patterns = random_prompts(count, vocab, 3, 7, seed=seed + 1)
    return [
        head + pattern * (2 + i % 3) for i, (head, pattern) in enumerate(zip(heads, patterns, strict=True))
    ]


@contextmanager
def engines_checked() -> Iterator[list[Engine]]:
    """Record the engines and run their integrity check after every step."""
    engines: list[Engine] = []
    original = Engine.step

    def step(self):
        result = original(self)
        self.check_integrity()
        if self not in engines:
            engines.append(self)
        return result

    with mock.patch.object(Engine, "step", step):
        yield engines


@contextmanager
def verified_runs() -> Iterator[list[tuple[int, int]]]:
    """(tokens verified, tokens appended) of every speculating request's step: appended < verified is a cut."""
    runs: list[tuple[int, int]] = []
    original = Scheduler._apply_verified

    def apply(self, entry, run):
        before = entry.request.num_tokens
        finished = original(self, entry, run)
        runs.append((len(run), entry.request.num_tokens - before))
        return finished

    with mock.patch.object(Scheduler, "_apply_verified", apply):
        yield runs


def generate(model, prompts, cb_config: ContinuousBatchingConfig, speculate: bool, **kwargs):
    extra = {"prompt_lookup_num_tokens": LOOKUP} if speculate else {}
    return model.generate_batch(
        prompts,
        greedy_config(MAX_NEW_TOKENS, kwargs.pop("eos_token_id", None)),
        continuous_batching_config=cb_config,
        progress_bar=False,
        **extra,
        **kwargs,
    )


def assert_accepted(outputs) -> None:
    accepted = sum(output.accepted_draft_tokens for output in outputs.values())
    drafted = sum(output.draft_tokens for output in outputs.values())
    assert accepted > 0, f"no draft token was accepted ({drafted} drafted): the test would pass vacuously"


@pytest.fixture(scope="module")
def _models() -> dict:
    return {}


def _model(cache: dict, family: str):
    if family not in cache:
        model = build_tiny_model(family, seed=0)
        cache[family] = (model, repeating_prompts(model), ReferenceCache(model, MAX_NEW_TOKENS))
    return cache[family]


@pytest.mark.parametrize("pressure", [False, True], ids=["roomy", "preemption"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_speculation_equals_generate_and_plain(_models, family: str, pressure: bool) -> None:
    model, prompts, references = _model(_models, family)
    page_size = 4
    num_blocks = pressure_num_blocks(model, prompts, page_size) if pressure else None
    cb_config = ContinuousBatchingConfig(
        speculation_max_batch_size=ALWAYS, page_size=page_size, max_batch_tokens=16, num_blocks=num_blocks
    )
    context = f"{family}, num_blocks={num_blocks}"
    with using_backend(model, family, backends_for(family)[0]):
        plain = generate(model, prompts, cb_config, speculate=False)
        with engines_checked() as engines, count_preemptions() as preemptions:
            outputs = generate(model, prompts, cb_config, speculate=True)
    check_parity(model, prompts, outputs, [references.get(p) for p in prompts], context)
    for request_id, output in outputs.items():
        assert output.generated_tokens == plain[request_id].generated_tokens, f"{context}: {request_id}"
    assert_accepted(outputs)
    if pressure:
        assert preemptions, f"{context}: nothing was preempted"
    (engine,) = engines
    assert engine.num_used_pages == 0
    snapshot = engine.snapshot()
    assert snapshot.speculation.accepted == sum(o.accepted_draft_tokens for o in outputs.values())


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_forks_speculate_and_share_their_prompt(_models, family: str) -> None:
    model, prompts, references = _model(_models, family)
    cb_config = ContinuousBatchingConfig(speculation_max_batch_size=ALWAYS, page_size=4, max_batch_tokens=32)
    with using_backend(model, family, backends_for(family)[0]), engines_checked():
        outputs = generate(model, prompts, cb_config, speculate=True, num_return_sequences=2)
    assert len(outputs) == 2 * len(prompts)
    for i, prompt in enumerate(prompts):
        for request_id in (f"req_{i}", f"req_{i}__child#0"):
            assert outputs[request_id].generated_tokens == references.get(prompt), request_id
    assert_accepted(outputs)


def test_max_new_tokens_and_eos_cut_inside_a_verified_run(_models) -> None:
    model, prompts, references = _model(_models, "llama")
    cb_config = ContinuousBatchingConfig(speculation_max_batch_size=ALWAYS, page_size=4, max_batch_tokens=64)
    prompt = prompts[0]
    limits = list(range(1, MAX_NEW_TOKENS + 1))
    # This random model's output repeats single tokens of its prompt, not pairs: drafts from 1-gram matches
    # (max_matching_ngram_size=1) are the ones it accepts.
    one_gram = {"max_matching_ngram_size": 1}
    with verified_runs() as runs:
        outputs = generate(
            model, [prompt] * len(limits), cb_config, speculate=True, max_new_tokens=limits, **one_gram
        )
    for i, limit in enumerate(limits):
        assert outputs[f"req_{i}"].generated_tokens == references.get(prompt)[:limit], limit
        assert outputs[f"req_{i}"].finish_reason == "length"
    assert_accepted(outputs)
    # Drafts stop short of max_new_tokens (the target's own token is the last one), so no run is cut by it
    # and no verified token is wasted; runs of several tokens do reach the limit.
    assert all(appended == verified for verified, appended in runs)
    assert any(verified > 1 for verified, _ in runs)
    # eos: the token at a late position of the greedy output (its first occurrence ends the request)
    expected = references.get(prompt)
    eos = expected[-3]
    cut = expected[: expected.index(eos) + 1]
    with verified_runs() as runs:
        outputs = generate(model, prompts[:1], cb_config, speculate=True, eos_token_id=eos, **one_gram)
    assert outputs["req_0"].generated_tokens == cut
    assert outputs["req_0"].finish_reason == "stop"
    assert_accepted(outputs)
    # Lookup drafts stop before an eos (as transformers'), so eos ends a run as the target's own token.
    assert all(appended == verified for verified, appended in runs)


def test_stop_strings_cut_inside_a_verified_run() -> None:
    """Stop strings end speculating requests exactly where `generate()` stops (a cut inside a verified run,
    the tokens after the stop dropped: tests/scheduler/test_speculation.py)."""
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model_with_tokenizer(seed=3, attn_implementation="paged|sdpa", tokenizer=tokenizer)
    prompt = tokenizer.encode("abcabcabc abcabc")
    free = GenerationConfig(max_new_tokens=MAX_NEW_TOKENS, do_sample=False, eos_token_id=None)
    text_ids = model.generate_batch([prompt], free, progress_bar=False)["req_0"].generated_tokens
    # Stop strings ending at each printable position of the output: some of those lie inside a run.
    pieces = [tokenizer.decode([token]) for token in text_ids]
    stops = sorted(
        {
            a + b
            for a, b in zip(pieces, pieces[1:], strict=False)
            if (a + b).isascii() and (a + b).isprintable()
        }
    )
    assert stops, tokenizer.decode(text_ids)
    cb_config = ContinuousBatchingConfig(speculation_max_batch_size=ALWAYS, per_request_processors=True)
    outputs = model.generate_batch(
        [prompt] * len(stops),
        free,
        continuous_batching_config=cb_config,
        tokenizer=tokenizer,
        stop_strings=[[stop] for stop in stops],
        prompt_lookup_num_tokens=LOOKUP,
        progress_bar=False,
    )
    ids = torch.tensor([prompt])
    for i, stop in enumerate(stops):
        config = GenerationConfig(
            max_new_tokens=MAX_NEW_TOKENS, do_sample=False, eos_token_id=None, stop_strings=[stop]
        )
        expected = model.generate(
            ids, attention_mask=torch.ones_like(ids), generation_config=config, tokenizer=tokenizer
        )
        assert outputs[f"req_{i}"].generated_tokens == expected[0, len(prompt) :].tolist(), stop
    assert_accepted(outputs)
