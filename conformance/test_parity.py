"""Greedy parity: `generate_batch` equals plain `generate()` run on each prompt alone, token for token.

Model families x attention backends x page sizes x token budgets (chunked prefill or not) x cache size
(auto, or just enough for the largest request so that requests are evicted and recomputed). The
`generate()` references are computed once per family and shared by every combination. A difference is
a failure unless the reference's logits show a genuine floating-point near-tie at that position.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass

import pytest
import torch
from transformers import GenerationConfig, PreTrainedModel

from conformance.common import (
    ReferenceCache,
    check_parity,
    compare_tokens,
    greedy_config,
    run_batch,
    tight_num_blocks,
)
from tests.support.models import BACKENDS, FAMILIES, build_tiny_model, using_backend, vocab_size
from tests.support.prompts import prompts_of_lengths, random_prompts
from tests.support.sharp import SHARP_FACTOR, sharpen
from transformers_cb import GenerationOutput, RequestStatus
from transformers_cb.attention.native import kernel as native
from transformers_cb.conformance_check import near_tie_tolerance, next_token_logits

MAX_NEW_TOKENS = 12
PAGE_SIZES = (4, 16, 256)
BUDGETS = (16, None)  # 16 forces chunked prefill; None is the library default
# Every family twice: as built, and sharp (query / key projections scaled by SHARP_FACTOR after init:
# attention far from uniform, so a wrong position, mask or cached key changes tokens).
SHARP = ":sharp"
VARIANTS = (*FAMILIES, *(f + SHARP for f in FAMILIES))


@dataclass
class Family:
    name: str  # the family (`<family>:sharp` for its sharp variant)
    model: PreTrainedModel
    references: ReferenceCache
    prompts: list[list[int]]  # 8 prompts of 1..40 tokens
    # For eviction with 256-token pages: long prompts that cross a page while decoding.
    long_prompts: list[list[int]]

    def tight_prompts(self, page_size: int) -> list[list[int]]:
        return self.prompts if page_size < 64 else self.long_prompts

    def backend(self, attn_implementation: str) -> AbstractContextManager[PreTrainedModel]:
        return using_backend(self.model, self.name.removesuffix(SHARP), attn_implementation)


@pytest.fixture(scope="module")
def _families() -> dict[str, Family]:
    return {}


@pytest.fixture(params=VARIANTS)
def family(request, _families: dict[str, Family]) -> Family:
    """The family's model (or its sharp variant) and its generate() references, built once per module."""
    name = request.param
    if name not in _families:
        model = build_tiny_model(name.removesuffix(SHARP), seed=0)
        if name.endswith(SHARP):
            scaled = sharpen(model, SHARP_FACTOR)  # not inside an assert: it must run under python -O
            assert scaled > 0, f"{name}: no query / key projection to scale"
        vocab = vocab_size(model)
        # Three requests fit in 3 pages of 256; the first crosses a page while the third is still
        # running, so the third is evicted.
        long_prompts = prompts_of_lengths([250, 3, 248, 9], vocab, seed=11)
        _families[name] = Family(
            name,
            model,
            ReferenceCache(model, MAX_NEW_TOKENS),
            random_prompts(8, vocab, 1, 40, seed=1),
            long_prompts,
        )
    return _families[name]


def _context(family: Family, backend: str, **cb_kwargs) -> str:
    settings = ", ".join(f"{k}={v}" for k, v in cb_kwargs.items())
    return f"{family.name} / attn_implementation={backend!r} / {settings}"


@pytest.mark.parametrize("budget", BUDGETS, ids=lambda b: f"budget{b}")
@pytest.mark.parametrize("page_size", PAGE_SIZES, ids=lambda p: f"page{p}")
@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_parity(family: Family, backend: str, page_size: int, budget: int | None) -> None:
    references = [family.references.get(p) for p in family.prompts]
    with family.backend(backend) as model:
        outputs, _ = run_batch(
            model, family.prompts, greedy_config(MAX_NEW_TOKENS), page_size=page_size, max_batch_tokens=budget
        )
        check_parity(
            model,
            family.prompts,
            outputs,
            references,
            _context(family, backend, page_size=page_size, max_batch_tokens=budget),
        )
        assert model.config._attn_implementation == backend, "generate_batch did not restore the backend"


@pytest.mark.parametrize("budget", BUDGETS, ids=lambda b: f"budget{b}")
@pytest.mark.parametrize("page_size", PAGE_SIZES, ids=lambda p: f"page{p}")
@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_parity_under_eviction(
    family: Family, backend: str, page_size: int, budget: int | None
) -> None:
    """A cache just big enough for the largest request: requests are evicted and recomputed."""
    prompts = family.tight_prompts(page_size)
    num_blocks = tight_num_blocks(prompts, MAX_NEW_TOKENS, page_size)
    references = [family.references.get(p) for p in prompts]
    with family.backend(backend) as model:
        outputs, preemptions = run_batch(
            model,
            prompts,
            greedy_config(MAX_NEW_TOKENS),
            page_size=page_size,
            max_batch_tokens=budget,
            num_blocks=num_blocks,
            # The recompute path on its own: with sharing, hits change which request gets evicted
            # (conformance/test_prefix_sharing.py covers sharing under eviction).
            allow_block_sharing=False,
        )
        context = _context(
            family, backend, page_size=page_size, max_batch_tokens=budget, num_blocks=num_blocks
        )
        assert preemptions, f"{context}: no request was evicted; the test does not exercise eviction"
        check_parity(model, prompts, outputs, references, context)


EOS_SOURCES = ("generation_config", "model_generation_config", "list")


@pytest.mark.parametrize("eos_source", EOS_SOURCES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_parity_with_eos(family: Family, backend: str, eos_source: str) -> None:
    """eos = the 4th greedy token of prompt 0: requests that hit it stop and include it, like generate()."""
    eos = family.references.get(family.prompts[0])[3]
    model = family.model
    if eos_source == "generation_config":
        config, model_eos, eos_ids = greedy_config(MAX_NEW_TOKENS, eos), None, [eos]
    elif eos_source == "model_generation_config":  # taken from the model when the config has none
        config, model_eos, eos_ids = (
            GenerationConfig(max_new_tokens=MAX_NEW_TOKENS, do_sample=False),
            eos,
            [eos],
        )
    else:  # several eos ids
        eos_ids = [vocab_size(model) - 1, eos]
        config, model_eos = greedy_config(MAX_NEW_TOKENS, eos_ids), None
    references = [family.references.get(p, eos_token_id=eos_ids) for p in family.prompts]
    assert len(references[0]) <= 4 and references[0][-1] == eos, references[0]
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = model_eos
    try:
        with family.backend(backend):
            for page_size, budget in [(4, 16), (256, None)]:
                outputs, _ = run_batch(
                    model, family.prompts, config, page_size=page_size, max_batch_tokens=budget
                )
                context = _context(family, backend, page_size=page_size, max_batch_tokens=budget, eos=eos_ids)
                check_parity(model, family.prompts, outputs, references, context, MAX_NEW_TOKENS, eos_ids)
                for i, expected in enumerate(references):
                    output = outputs[f"req_{i}"]
                    stopped_at_eos = expected[-1] in eos_ids
                    assert output.finish_reason == ("stop" if stopped_at_eos else "length"), (
                        context,
                        i,
                        output,
                    )
                    assert output.status == RequestStatus.FINISHED
                assert outputs["req_0"].generated_tokens[-1] == eos
    finally:
        model.generation_config.eos_token_id = saved


def test_a_bfloat16_near_tie_is_measured_in_ulps_of_its_logits() -> None:
    """bfloat16 logits of magnitude ~25 are 0.125 apart when unequal: a gap of two ulps there is a near-tie
    (the real model's "What is the capital of France?": 25.75 against 25.5 in bfloat16, 0.08 apart in
    float32), while the same gap between logits of magnitude ~1, where the absolute bound applies, is not."""
    assert near_tie_tolerance(torch.float32, 25.75) == 1e-4
    assert near_tie_tolerance(torch.bfloat16, 0.5) == 5e-2
    assert 0.25 < near_tie_tolerance(torch.bfloat16, 25.75) < 0.5  # 2-4 ulps of 25.75 (one ulp: 0.125)
    assert 2 * 2.0**-7 < near_tie_tolerance(torch.float16, 25.75) < 4 * 2.0**-6  # 2-4 ulps (one: 2^-6)
    model = build_tiny_model("llama", seed=5).to(torch.bfloat16)
    prompt = random_prompts(1, vocab_size(model), 10, 10, seed=5)[0]
    logits = next_token_logits(model, prompt)
    top = int(logits.argmax())
    runner_up = (top + 1) % vocab_size(model)
    with torch.no_grad():  # the top logit ~30, the runner-up's 1 % below it: 2-3 bf16 ulps
        model.lm_head.weight.mul_(30.0 / float(logits[top]))
        model.lm_head.weight[runner_up] = model.lm_head.weight[top] * 0.99
    logits = next_token_logits(model, prompt)
    gap = float(logits[top] - logits[runner_up])
    assert int(logits.argmax()) == top and 5e-2 < gap < near_tie_tolerance(torch.bfloat16, float(logits[top]))
    mismatch = compare_tokens(model, "req_0", prompt, [top], [runner_up])
    assert mismatch is not None and mismatch.is_near_tie and mismatch.tolerance > 5e-2, mismatch
    explicit = compare_tokens(model, "req_0", prompt, [top], [runner_up], tolerance=gap / 2)
    assert explicit is not None and not explicit.is_near_tie  # an explicit tolerance is taken as given


def test_near_ties_are_accepted_only_with_the_right_continuation() -> None:
    """An exact logit tie between two tokens is accepted when the rest continues generate() from the
    tied token; a wrong continuation after it, or any other difference, fails."""
    model = build_tiny_model("llama", seed=5)
    prompt = random_prompts(1, vocab_size(model), 10, 10, seed=5)[0]
    logits = next_token_logits(model, prompt)
    top, low = int(logits.argmax()), int(logits.argmin())
    twin = (top + 1) % vocab_size(model)
    with torch.no_grad():
        model.lm_head.weight[twin] = model.lm_head.weight[top]
    tie = compare_tokens(model, "req_0", prompt, [top, 5], [twin, 5])
    assert tie is not None and tie.index == 0 and tie.is_near_tie and tie.margin == 0.0, tie
    real = compare_tokens(model, "req_0", prompt, [top, 5], [low, 5])
    assert real is not None and not real.is_near_tie and real.margin > 1e-3, real
    shorter = compare_tokens(model, "req_0", prompt, [top, 5], [top])
    assert shorter is not None and shorter.index == 1 and not shorter.is_near_tie
    assert compare_tokens(model, "req_0", prompt, [top, 5], [top, 5]) is None

    def outputs(tokens):
        return {"req_0": GenerationOutput("req_0", prompt, tokens, RequestStatus.FINISHED)}

    after_top = int(next_token_logits(model, [*prompt, top]).argmax())
    after_twin = int(next_token_logits(model, [*prompt, twin]).argmax())
    wrong = next(t for t in range(3, vocab_size(model)) if t != after_twin)
    check_parity(model, [prompt], outputs([twin, after_twin]), [[top, after_top]], "tie")  # passes
    with pytest.raises(pytest.fail.Exception, match="NOT a near-tie"):
        check_parity(model, [prompt], outputs([twin, wrong]), [[top, after_top]], "tie, wrong continuation")
    with pytest.raises(pytest.fail.Exception, match="NOT a near-tie"):
        check_parity(model, [prompt], outputs([low, after_top]), [[top, after_top]], "real")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_low_precision_uneven_decodes_equal_generate_exactly(
    name: str, dtype: torch.dtype, monkeypatch
) -> None:
    """Eight prompts of uneven lengths decoding side by side in bf16 / fp16 (how the documents load
    models), on the torch kernels: every request's tokens equal its own `generate()` run, exactly. Each
    decode attends at its own KV length (no padded keys) through the same SDPA call generate() makes, so
    nothing but the batch shape differs from running alone; padded decode groups used to flip an exact
    bf16 tie here (qwen3 bf16, req token 45). fp16 on qwen3 keeps one genuine near-tie (logit margin
    2e-4) and is checked tie-aware.
    The native CPU kernel is off here: it accumulates in float32 where SDPA rounds its probabilities to
    bf16, so its outputs part from generate() at exact bf16 logit ties (margin 0); its parity is checked
    tie-aware in tests/attention/test_native_kernel.py."""
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    model = build_tiny_model(name, seed=0, attn_implementation="paged|sdpa").to(dtype)
    prompts = random_prompts(8, vocab_size(model), 3, 40, seed=1)
    config = GenerationConfig(max_new_tokens=48, do_sample=False, eos_token_id=None, pad_token_id=0)
    outputs, _ = run_batch(model, prompts, config, page_size=16, max_batch_tokens=256)
    with using_backend(model, name, "sdpa"):
        references = []
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
            references.append(out[0, len(prompt) :].tolist())
    if (name, dtype) == ("qwen3", torch.float16):
        check_parity(model, prompts, outputs, references, f"{name} {dtype}")
        return
    for i, expected in enumerate(references):
        assert outputs[f"req_{i}"].generated_tokens == expected, f"{name} {dtype}: req_{i}"
