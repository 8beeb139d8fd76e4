"""Batch-invariant mode (`ContinuousBatchingConfig(batch_invariant=True)`, runner/products/batch_invariant.py).

A request's tokens and logprobs must be the same bits alone and batched with 7 or 31 others, under any
token budget (its prompt chunked at other places), float32 and bfloat16, on a model whose attention is
sharp (a wrong key order or reduction moves the argmax). The model has head size 64 (the native kernel's
fixed-shape kernels), an intermediate size that is no multiple of the vector width (SiLU's scalar tail)
and a 150-token prompt, longer than the native kernel's default share of bf16 prefill work: in default
mode the same request's logprobs change with its neighbours and its chunking (measured on this CPU).
"""

from __future__ import annotations

import random
import sys

import pytest
import torch
import torch.nn.functional as F
from transformers import CompileConfig, GenerationConfig
from transformers.pytorch_utils import Conv1D

from tests.support.manager import collect
from tests.support.models import sharpen_attention, tiny_llama
from tests.support.prompts import prompts_of_lengths, random_prompts
from tests.support.threads import TIMEOUT
from transformers_cb import ContinuousBatchingConfig
from transformers_cb.attention.native.kernel import ensure_native_module
from transformers_cb.engine.build import build_engine
from transformers_cb.engine.intake.submission import Submission
from transformers_cb.runner.forward.compiling import CompileSettings
from transformers_cb.runner.products.batch_invariant import (
    INVARIANT_ROWS,
    batch_invariant_modules,
    invariant_elementwise,
    invariant_linear,
)
from transformers_cb.runner.step_options import check_batch_invariant

GREEDY = GenerationConfig(max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
DTYPES = [torch.float32, torch.bfloat16]
# Rows of a step beside the request: none, 7 and 31 others (batch sizes 1, 8 and 32).
NEIGHBOURS = [0, 7, 31]
# Token budgets: none (the prompt in one chunk), and budgets that cut it at other places.
BUDGETS = [None, 16, 37, 128]


@pytest.fixture(autouse=True)
def _native_kernel() -> None:
    if ensure_native_module() is None:
        pytest.skip("the native CPU kernel cannot be built here (see the logged reason)")


def sharp_model(dtype: torch.dtype):
    model = tiny_llama(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=200)
    return sharpen_attention(model).to(dtype)


def run_target(model, others: list[list[int]], budget: int | None, target: list[int], kv_cache_dtype="auto"):
    """The target request's (tokens, logprobs), placed in the middle of `others`."""
    half = len(others) // 2
    prompts = [*others[:half], target, *others[half:]]
    config = ContinuousBatchingConfig(
        return_logprobs=True,
        page_size=16,
        max_batch_tokens=budget,
        batch_invariant=True,
        kv_cache_dtype=kv_cache_dtype,
    )
    out = model.generate_batch(prompts, GREEDY, config, progress_bar=False)[f"req_{half}"]
    return out.generated_tokens, out.logprobs


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_logprobs_are_bitwise_the_same_alone_batched_and_chunked(dtype: torch.dtype) -> None:
    model = sharp_model(dtype)
    target = prompts_of_lengths([150], seed=7)[0]
    others = random_prompts(31, model.config.vocab_size, 1, 60, seed=3)
    alone = run_target(model, [], None, target)
    assert len(alone[1]) == GREEDY.max_new_tokens and all(lp is not None for lp in alone[1])
    differing = [
        (n, budget)
        for n in NEIGHBOURS
        for budget in BUDGETS
        if run_target(model, others[:n], budget, target) != alone
    ]
    assert not differing, (
        f"{dtype}: (neighbours, max_batch_tokens) whose tokens or logprobs differ: {differing}"
    )


def test_an_int8_kv_cache_is_batch_invariant_too() -> None:
    """int8 pages (docs/quantization.md): each token's row quantized alone, every prefill token on the
    kernel's int8 instance: the same bits alone, batched and chunked."""
    model = sharp_model(torch.float32)
    target = prompts_of_lengths([150], seed=7)[0]
    others = random_prompts(7, model.config.vocab_size, 1, 60, seed=3)
    alone = run_target(model, [], None, target, "int8")
    differing = [
        (n, budget)
        for n in (0, 7)
        for budget in (None, 16, 37)
        if run_target(model, others[:n], budget, target, "int8") != alone
    ]
    assert not differing, (
        f"int8 KV: (neighbours, max_batch_tokens) whose tokens or logprobs differ: {differing}"
    )


def test_the_thread_count_does_not_change_the_bits() -> None:
    """A manager's threads may change between steps (the server's adaptive threads): a request run alone on
    one thread equals it batched on two (fixed-shape products split their columns, never a reduction; the
    native kernel's threads split (token, head) items)."""
    model = sharp_model(torch.float32)
    target = prompts_of_lengths([150], seed=7)[0]
    others = random_prompts(7, model.config.vocab_size, 1, 60, seed=3)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = run_target(model, [], None, target)
        torch.set_num_threads(2)
        batched = run_target(model, others, 37, target)
    finally:
        torch.set_num_threads(saved)
    assert batched == alone


def test_every_request_of_a_batch_matches_its_own_run_alone() -> None:
    """Each of 8 requests of mixed lengths, batched under a small budget, equals its own run alone."""
    model = sharp_model(torch.float32)
    prompts = random_prompts(8, model.config.vocab_size, 5, 90, seed=5)
    config = ContinuousBatchingConfig(
        return_logprobs=True, page_size=16, max_batch_tokens=24, batch_invariant=True
    )
    batched = model.generate_batch(prompts, GREEDY, config, progress_bar=False)
    for i, prompt in enumerate(prompts):
        alone = run_target(model, [], None, prompt)
        assert (batched[f"req_{i}"].generated_tokens, batched[f"req_{i}"].logprobs) == alone, f"req_{i}"


def test_greedy_tokens_match_generate() -> None:
    """The fixed-shape products change the rounding, never the model: greedy tokens are `generate()`'s."""
    model = sharp_model(torch.float32)
    prompts = random_prompts(4, model.config.vocab_size, 5, 60, seed=11)
    config = ContinuousBatchingConfig(page_size=16, max_batch_tokens=24, batch_invariant=True)
    out = model.generate_batch(prompts, GREEDY, config, progress_bar=False)
    for i, prompt in enumerate(prompts):
        reference = model.generate(torch.tensor([prompt]), generation_config=GREEDY)[0, len(prompt) :]
        assert out[f"req_{i}"].generated_tokens == reference.tolist(), f"req_{i}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_invariant_linear_rows_do_not_depend_on_the_other_rows(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    weight, bias = torch.randn(300, 200).to(dtype), torch.randn(300).to(dtype)
    rows = torch.randn(70, 200).to(dtype)
    alone = invariant_linear(rows[:1], weight, bias)
    torch.testing.assert_close(alone, F.linear(rows[:1], weight, bias))
    for count in (2, INVARIANT_ROWS - 1, INVARIANT_ROWS, INVARIANT_ROWS + 1, 69):
        for place in (0, count // 2, count - 1):
            batch = rows[1 : count + 1].clone()
            batch[place] = rows[0]
            assert torch.equal(invariant_linear(batch, weight, bias)[place], alone[0]), (count, place)
    # Any leading dimensions: [1, T, K] as the model's hidden states come.
    assert torch.equal(invariant_linear(rows[None, :5], weight, bias)[0, 0], alone[0])


def test_conv1d_products_are_invariant_too() -> None:
    """transformers' `Conv1D` (GPT-2's products, its weight `[in, out]`) takes the same fixed-shape calls."""
    torch.manual_seed(0)
    module = Conv1D(300, 200).eval()
    torch.nn.init.normal_(module.bias)
    rows = torch.randn(40, 200)
    with batch_invariant_modules(module, True) as count, torch.inference_mode():
        assert count == 1
        alone = module(rows[:1])
        torch.testing.assert_close(alone, torch.addmm(module.bias, rows[:1], module.weight))
        for count in (3, 17, 40):
            assert torch.equal(module(rows[:count])[0], alone[0]), count
    assert "forward" not in module.__dict__


@pytest.mark.parametrize("function", [F.silu, F.gelu], ids=["silu", "gelu"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_invariant_activation_rows_do_not_depend_on_the_other_rows(function, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    rows = (torch.randn(400, 200) * 4).to(dtype)
    alone = invariant_elementwise(function, rows[:1])
    torch.testing.assert_close(alone, function(rows[:1]))
    for count in (2, 3, 33, 200, 400):  # 400 x 256 padded elements: several blocks
        assert torch.equal(invariant_elementwise(function, rows[:count])[0], alone[0]), count
        assert torch.equal(
            invariant_elementwise(function, rows[:count])[count - 1], alone_row(function, rows[count - 1])
        )


def alone_row(function, row: torch.Tensor) -> torch.Tensor:
    return invariant_elementwise(function, row[None])[0]


def test_modules_are_patched_for_the_run_only() -> None:
    model = sharp_model(torch.float32)
    linear, act = model.model.layers[0].mlp.down_proj, model.model.layers[0].mlp.act_fn
    with batch_invariant_modules(model, True) as count:
        assert "forward" in linear.__dict__ and "forward" in act.__dict__
        # q, k, v, o, gate, up, down per layer and the LM head; one activation per layer.
        assert count == 8 * model.config.num_hidden_layers + 1
        with batch_invariant_modules(model, True):  # an overlapping run shares the patches
            pass
        assert "forward" in linear.__dict__
    assert "forward" not in linear.__dict__ and "forward" not in act.__dict__
    with batch_invariant_modules(model, False) as count:
        assert count == 0 and "forward" not in linear.__dict__


def test_engine_settings_turns_off_packed_products_and_native_layer_ops() -> None:
    model = sharp_model(torch.float32)
    config = ContinuousBatchingConfig(page_size=16, batch_invariant=True, packed_linear=True)
    engine = build_engine(model, GREEDY, config)
    options = engine.settings.step_options
    assert options.batch_invariant and not options.packed_linear and not options.native_layers
    assert engine.runner.packer.native_prefill_max_work == sys.maxsize  # every chunk on the native kernel


@pytest.mark.parametrize(
    ("device", "settings", "problem"),
    [
        ("cuda", CompileSettings(), "CPU only"),
        ("cpu", CompileSettings(decode=CompileConfig()), "compiled forward"),
    ],
)
def test_unsupported_setups_are_refused_at_start(
    device: str, settings: CompileSettings, problem: str
) -> None:
    with pytest.raises(ValueError, match=f"batch_invariant=True: .*{problem}"):
        check_batch_invariant(device, None, settings)


def test_the_native_kernel_switched_off_is_refused(monkeypatch) -> None:
    monkeypatch.setenv("TRANSFORMERS_CB_NATIVE_KERNEL", "0")
    with pytest.raises(ValueError, match="batch_invariant=True: .*TRANSFORMERS_CB_NATIVE_KERNEL=0"):
        check_batch_invariant("cpu", None, CompileSettings())


def test_a_prefix_computed_by_another_request_gives_the_same_bits() -> None:
    """With prefix sharing, the target's first pages come from a request that ran before it in a batch of
    other shapes: each token's K/V is the same bits whoever computed it."""
    model = sharp_model(torch.float32)
    target = prompts_of_lengths([150], seed=7)[0]
    alone = run_target(model, [], None, target)
    sibling = target[:96] + prompts_of_lengths([30], seed=8)[0]
    config = ContinuousBatchingConfig(
        return_logprobs=True, page_size=16, max_batch_tokens=40, batch_invariant=True
    )
    engine = build_engine(model, GREEDY, config)
    with engine.session():
        for prompt_ids, request_id in ((sibling, "sibling"), (target, "target")):
            request = engine.build_request(Submission(prompt_ids, request_id))
            engine.add(request)
            while engine.has_work():
                engine.step()
    assert engine.snapshot().prefix.hit_tokens >= 96, "no prefix hit: the test does not exercise sharing"
    assert (list(request.generated_ids), request.logprobs) == alone


def test_compile_level_is_refused_by_the_engine() -> None:
    model = sharp_model(torch.float32)
    config = ContinuousBatchingConfig(page_size=16, batch_invariant=True, default_compile_level=1)
    with pytest.raises(ValueError, match="batch_invariant=True: a compiled forward"):
        model.generate_batch([[5, 6, 7]], GREEDY, config, progress_bar=False)


def test_the_manager_thread_keeps_a_request_invariant_while_others_come_and_go() -> None:
    """The manager's thread runs the same session: a request added beside a stream of others (arriving
    while it decodes, so its steps mix prefill chunks and decodes) equals its run alone."""
    model = sharp_model(torch.float32)
    target = prompts_of_lengths([150], seed=7)[0]
    alone = run_target(model, [], None, target)
    config = ContinuousBatchingConfig(
        return_logprobs=True, page_size=16, max_batch_tokens=48, batch_invariant=True
    )
    manager = model.init_continuous_batching(continuous_batching_config=config, generation_config=GREEDY)
    manager.start()
    try:
        others = random_prompts(12, model.config.vocab_size, 1, 60, seed=9)
        first = manager.add_requests(others[:4]) or []
        manager.add_request(target, request_id="target")
        later = manager.add_requests(others[4:]) or []
        results = collect(manager, ["target", *first, *later])
    finally:
        manager.stop(block=True, timeout=TIMEOUT)
    assert (results["target"].generated_tokens, results["target"].logprobs) == alone


def test_speculating_requests_keep_their_logprobs() -> None:
    """Prompt lookup verifies draft tokens as extra rows of the request's step: the same kernels, the same
    bits as decoding them one by one."""
    model = sharp_model(torch.float32)
    target = list(range(3, model.config.vocab_size))  # every token once: 1-grams always find a draft
    random.Random(7).shuffle(target)
    alone = run_target(model, [], None, target)
    config = ContinuousBatchingConfig(return_logprobs=True, page_size=16, batch_invariant=True)
    lookup = {"prompt_lookup_num_tokens": 4, "max_matching_ngram_size": 1}
    out = model.generate_batch([target], GREEDY, config, progress_bar=False, **lookup)["req_0"]
    assert out.draft_tokens > 0, "nothing was drafted: the test does not exercise verification"
    assert (out.generated_tokens, out.logprobs) == alone
