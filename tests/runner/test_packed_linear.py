"""Packed oneDNN products (`ContinuousBatchingConfig.packed_linear`): the op against `F.linear`, its fake
implementation under `torch.compile`, greedy parity with `generate()`, packs never stale after a weight
update, the user's modules restored after every kind of run, and the one-warning fallback."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import transformers_cb
from tests.support.models import sharpen_attention, tiny_llama
from tests.support.prompts import prompts_of_lengths
from tests.support.reference import greedy_reference
from tests.support.threads import TIMEOUT
from transformers_cb import ContinuousBatchingConfig
from transformers_cb.api.generate_batch import CACHED_ENGINE_ATTR
from transformers_cb.memory.sizing import CPU_MEMORY_PERCENT
from transformers_cb.parity.compare import compare_tokens
from transformers_cb.runner import step_options
from transformers_cb.runner.products import packed_linear as packed_linear_module
from transformers_cb.runner.products import small_rows
from transformers_cb.runner.products.packed_linear import (
    NEVER,
    PACKS,
    RULE_ENV,
    PackRule,
    cpu_lacks_support,
    packed_linear,
    packed_linear_available,
    reset_verdicts,
    rule_from_env,
    self_test,
)
from transformers_cb.runner.products.packed_model import _pack_size, pack_bytes, packed_linears, release_packs
from transformers_cb.runner.step_options import resolve_packed_linear

pytestmark = pytest.mark.skipif(
    packed_linear_module.unsupported_reason(torch.float32, "cpu") is not None,
    reason="packed oneDNN products need x86 with oneDNN",
)

PACKED = ContinuousBatchingConfig(page_size=16, packed_linear=True)
PROMPTS = prompts_of_lengths([5, 17, 30, 9], seed=3)
MAX_NEW = 10
LOGGER = "transformers_cb.runner.products.packed_linear"


@pytest.fixture(autouse=True)
def fresh_verdicts(monkeypatch):
    # The tiny models' weights are below the measured rule's sizes in fp32: pack every weight here, so
    # that these tests run packed products (the rule itself is tested below, without this override).
    monkeypatch.setenv(RULE_ENV, "all")
    reset_verdicts()
    yield
    reset_verdicts()


def linear_state(model: nn.Module) -> list[tuple[int, type, tuple[str, ...], int]]:
    """What a run must leave as it found it: each module's identity, type, instance attributes, weight."""
    return [
        (id(module), type(module), tuple(sorted(module.__dict__)), id(getattr(module, "weight", None)))
        for module in model.modules()
    ]


def generate_packed(model, config: ContinuousBatchingConfig = PACKED, **kwargs) -> list[list[int]]:
    outputs = model.generate_batch(
        PROMPTS, max_new_tokens=MAX_NEW, continuous_batching_config=config, progress_bar=False, **kwargs
    )
    return [outputs[f"req_{i}"].generated_tokens for i in range(len(PROMPTS))]


def assert_like_generate(model, got: list[list[int]]) -> None:
    for i, (prompt, tokens) in enumerate(zip(PROMPTS, got, strict=True)):
        mismatch = compare_tokens(model, f"req_{i}", prompt, greedy_reference(model, prompt, MAX_NEW), tokens)
        assert mismatch is None or mismatch.is_near_tie, mismatch.describe()


# -- the op ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [1, 3, 16, 70])
@pytest.mark.parametrize("with_bias", [True, False])
def test_op_equals_f_linear(rows: int, with_bias: bool) -> None:
    torch.manual_seed(rows)
    weight, bias = torch.randn(96, 64), torch.randn(96)
    x = torch.randn(1, rows, 64)
    handle = PACKS.new_handle()
    try:
        with torch.inference_mode():
            b = bias if with_bias else None
            got, want = packed_linear(x, weight, b, handle), F.linear(x, weight, b)
            # fp32: another summation order, ~5e-6 relative (issue 29's measurement).
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            # bf16: oneDNN and the plain path round the same fp32 accumulation: bitwise equal here.
            wb, bb, xb = weight.bfloat16(), bias.bfloat16() if with_bias else None, x.bfloat16()
            assert torch.equal(packed_linear(xb, wb, bb, handle), F.linear(xb, wb, bb))
    finally:
        PACKS.drop(handle)


def test_op_fake_implementation_compiles() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16, bias=False))
    x = torch.randn(5, 32)
    with torch.inference_mode():
        plain = model(x)
        with packed_linears(model, True) as swapped:
            assert swapped == 2
            compiled = torch.compile(model, fullgraph=True, dynamic=True, backend="inductor")
            eager = model(x)
            got = compiled(x)
            other = compiled(torch.randn(9, 32))  # another row count: the same dynamic graph
    torch.testing.assert_close(got, eager, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got, plain, rtol=1e-5, atol=1e-5)
    assert other.shape == (9, 16)


def test_opcheck_fake_matches_real() -> None:
    handle = PACKS.new_handle()
    try:
        x, weight, bias = torch.randn(4, 8), torch.randn(6, 8), torch.randn(6)
        torch.library.opcheck(
            torch.ops.transformers_cb.packed_linear.default,
            (x, weight, bias, handle),
            test_utils=("test_schema", "test_faketensor"),
        )
    finally:
        PACKS.drop(handle)


def test_compiled_packed_run_matches_generate_and_compiles_once() -> None:
    """Level 1 with packed products: the op is inside the compiled graphs, the tokens follow `generate()`,
    and a second run (the Linears' forwards set again) reuses the graphs instead of recompiling."""
    torch._dynamo.reset()
    model = tiny_llama()
    config = ContinuousBatchingConfig(
        page_size=16, max_batch_tokens=16, default_compile_level=1, packed_linear=True
    )
    outputs = []
    for _ in range(2):
        got = model.generate_batch(
            PROMPTS,
            max_new_tokens=MAX_NEW,
            continuous_batching_config=config,
            progress_bar=False,
            persistent_manager=True,
        )
        outputs.append([got[f"req_{i}"].generated_tokens for i in range(len(PROMPTS))])
        engine = getattr(model, CACHED_ENGINE_ATTR)[1]
        if len(outputs) == 1:
            graphs = engine.snapshot().compiled_graphs
            assert graphs >= 1
    assert engine.snapshot().compiled_graphs == graphs
    assert outputs[0] == outputs[1]
    assert_like_generate(model, outputs[0])
    model.destroy_cached_continuous_batching_manager()


# -- a run --------------------------------------------------------------------------------------------


def test_greedy_generate_batch_equals_generate_with_packed_products() -> None:
    model = tiny_llama()
    before = linear_state(model)
    assert packed_linear_available(torch.float32, "cpu")  # its self-test's pack counted before
    builds = PACKS.builds
    got = generate_packed(model)
    # 2 layers x 4 products (q/k/v and gate/up fused) + the LM head, each packed (its pack built) once.
    assert PACKS.builds - builds == 9
    assert linear_state(model) == before
    assert_like_generate(model, got)


def test_packed_products_really_run(monkeypatch) -> None:
    calls = []
    real = torch.ops.mkldnn._linear_pointwise

    def counting(*args):
        calls.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", counting)
    # oneDNN's calls are counted: decode rows would take the small-row product (small_rows.py) instead
    monkeypatch.setenv("TRANSFORMERS_CB_SMALL_ROW_PRODUCTS", "0")
    model = tiny_llama()
    generate_packed(model, warmup=False)
    assert calls, "no packed product ran"
    calls.clear()
    generate_packed(model, ContinuousBatchingConfig(page_size=16, packed_linear=False), warmup=False)
    assert not calls


@pytest.mark.parametrize(
    "update", ["zero_in_place", "load_state_dict", "optimizer_step", "through_data", "new_tensors"]
)
def test_a_weight_update_between_runs_is_seen(update: str) -> None:
    """A stale pack would repeat the first run's tokens; the second run must follow the new weights as
    `generate()` does. The packs outlive the engine (one per Linear per model), so two engines see the
    same packs; a persistent engine is not used here because its prefix cache keeps KV pages computed
    with the old weights, a staleness of its own that packing does not change."""
    model = tiny_llama()
    builds = PACKS.builds
    first = generate_packed(model)
    after_first = PACKS.builds
    assert_like_generate(model, first)
    if update == "zero_in_place":
        with torch.no_grad():
            model.lm_head.weight[: model.config.vocab_size // 2].zero_()
            model.model.layers[0].mlp.down_proj.weight.zero_()
    elif update == "load_state_dict":
        model.load_state_dict(tiny_llama(seed=7).state_dict())
    elif update == "through_data":  # bumps no version counter: the run's start compares a sample of values
        generator = torch.Generator().manual_seed(3)
        for parameter in model.parameters():
            parameter.data.add_(torch.randn(parameter.shape, generator=generator))
    elif update == "new_tensors":  # new storage, version 0 again (its address may be the freed one's)
        for parameter in model.parameters():
            parameter.data = parameter.data * -1.5
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=50.0)
        model.train()
        model(torch.tensor([PROMPTS[0]]), labels=torch.tensor([PROMPTS[0]])).loss.backward()
        optimizer.step()
        model.eval()
    second = generate_packed(model)
    assert second != first, "the update changed nothing: the test could not see a stale pack"
    assert_like_generate(model, second)
    # Packs are reused across runs and rebuilt only for the weights that changed.
    rebuilt = PACKS.builds - after_first
    assert after_first > builds and 0 < rebuilt <= after_first - builds
    if update == "zero_in_place":
        assert rebuilt == 2


def test_release_packs_sees_writes_through_data() -> None:
    model = tiny_llama()
    first = generate_packed(model)
    model.lm_head.weight.data[: model.config.vocab_size // 2].zero_()  # bumps no version counter
    release_packs(model)
    second = generate_packed(model)
    assert second != first
    assert_like_generate(model, second)


def test_manager_run_packed_and_modules_restored_after_stop() -> None:
    model = tiny_llama()
    before = linear_state(model)
    manager = model.init_continuous_batching(continuous_batching_config=PACKED)
    manager.start()
    try:
        ids = [manager.add_request(prompt, max_new_tokens=MAX_NEW) for prompt in PROMPTS]
        results = {}
        while len(results) < len(ids):
            output = manager.get_result(timeout=TIMEOUT)
            assert output is not None, "no result in time"
            results[output.request_id] = output
    finally:
        stats = manager.stats()
        manager.stop(block=True, timeout=TIMEOUT)
    assert linear_state(model) == before
    assert_like_generate(model, [results[i].generated_tokens for i in ids])
    # Every Linear weight has a packed copy (q/k/v and gate/up as one each): their bytes, in stats().
    weights = sum(m.weight.numel() * 4 for m in model.modules() if isinstance(m, nn.Linear))
    assert stats.packed_weight_bytes >= weights


def test_uninstall_restores_the_modules_of_a_run_in_progress() -> None:
    model = tiny_llama()
    before = linear_state(model)
    with packed_linears(model, True) as swapped:
        assert swapped == 15
        assert linear_state(model) != before
        transformers_cb.uninstall()
        try:
            assert linear_state(model) == before
        finally:
            transformers_cb.install()
    assert linear_state(model) == before


def test_training_and_plain_generate_untouched() -> None:
    model, twin = tiny_llama(), tiny_llama()
    ids = torch.tensor([PROMPTS[1]])
    generate_packed(model)
    with packed_linears(model, True):
        # Autograd recording inside the block takes the plain products: gradients exist and match.
        loss = model(ids, labels=ids).loss
        loss.backward()
    twin(ids, labels=ids).loss.backward()
    assert torch.equal(loss, twin(ids, labels=ids).loss)
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, twin(ids).logits)  # plain forward after the run: plain products
    assert greedy_reference(model, PROMPTS[2], MAX_NEW) == greedy_reference(twin, PROMPTS[2], MAX_NEW)


# -- fallback and config --------------------------------------------------------------------------------


@pytest.mark.parametrize("cause", ["no_onednn", "self_test_fails"])
def test_fallback_warns_once_and_runs_plain(cause: str, monkeypatch, caplog) -> None:
    if cause == "no_onednn":
        monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    else:
        monkeypatch.setattr(packed_linear_module, "self_test", lambda dtype: "self-test: differs")
    model = tiny_llama()
    before = linear_state(model)
    builds = PACKS.builds
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        first = generate_packed(model)
        second = generate_packed(model)
    warnings = [r for r in caplog.records if r.name == LOGGER]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert ("oneDNN" if cause == "no_onednn" else "self-test") in warnings[0].getMessage()
    assert PACKS.builds == builds and linear_state(model) == before
    assert first == second
    assert_like_generate(model, first)


def test_available_here_and_refused_off_cpu_or_other_dtypes(caplog) -> None:
    assert packed_linear_available(torch.float32, "cpu")
    assert packed_linear_available(torch.bfloat16, "cpu")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert not packed_linear_available(torch.float16, "cpu")
        assert not packed_linear_available(torch.float32, "cuda")
    assert len([r for r in caplog.records if r.name == LOGGER]) == 1


def test_config_field_default_auto_and_validated() -> None:
    assert ContinuousBatchingConfig().packed_linear is None
    with pytest.raises(ValueError, match="packed_linear"):
        ContinuousBatchingConfig(packed_linear=1)


# -- the default: the measured rule, the memory check --------------------------------------------------


def test_rule_by_dtype_size_and_env(monkeypatch) -> None:
    rule = PackRule()
    assert rule.min_rows(torch.empty(512, 128)) == NEVER  # the tiny model's fp32 layers: MKL wins
    # from the first row where the native float32 small-row product runs (it beats MKL there), else MKL first
    native = small_rows.rows_module(torch.float32) is not None
    assert rule.min_rows(torch.empty(512, 512)) == (1 if native else 16)
    assert rule.min_rows(torch.empty(32000, 512)) == (1 if native else 4)
    monkeypatch.setenv(small_rows.ENV_SWITCH, "0")
    assert rule.min_rows(torch.empty(512, 512)) == 16
    assert rule.min_rows(torch.empty(32000, 512)) == 4
    assert rule.min_rows(torch.empty(64, 64, dtype=torch.bfloat16)) == 1
    assert PackRule(every_weight=True).min_rows(torch.empty(8, 8)) == 1
    for value, expected in (("off", None), ("0", None), ("all", PackRule(True)), ("auto", PackRule())):
        monkeypatch.setenv(RULE_ENV, value)
        assert rule_from_env() == expected


def test_auto_packs_only_what_pays(monkeypatch) -> None:
    monkeypatch.setenv(RULE_ENV, "auto")
    model = tiny_llama()  # fp32, 64 wide: no weight reaches the rule's size
    assert resolve_packed_linear(model, None, "cpu", None) is False
    with packed_linears(model, True) as swapped:
        assert swapped == 0
    bf16 = tiny_llama().to(torch.bfloat16)
    assert resolve_packed_linear(bf16, None, "cpu", None) is True
    with packed_linears(bf16, True) as swapped:
        assert swapped == sum(isinstance(m, nn.Linear) for m in bf16.modules())


def test_the_self_test_packs_even_when_called_in_inference_mode(monkeypatch) -> None:
    """The verdict's first asker may be in inference mode (a benchmark, a server): its tensors would be
    inference tensors, which `packed_linear` sends to `F.linear`, so a CPU whose oneDNN refuses the dtype
    passed the self-test and every step failed later (AVX2, bf16)."""

    def refusing(weight: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx512bw")

    monkeypatch.setattr(packed_linear_module, "reorder", refusing)
    with torch.inference_mode():
        verdict = self_test(torch.float32)
    assert verdict is not None and cpu_lacks_support(verdict)


def test_silent_off_platform_by_default(monkeypatch, caplog) -> None:
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert not packed_linear_available(torch.float32, "cpu", asked=False)
        assert not packed_linear_available(torch.float32, "cuda", asked=False)
    assert not [r for r in caplog.records if r.name == LOGGER]


def test_row_packs_that_do_not_fit_leave_onednn_s_products_alone(monkeypatch, caplog) -> None:
    if small_rows.rows_module(torch.bfloat16) is None:
        pytest.skip("no bf16 small-row product here")
    model = tiny_llama().to(torch.bfloat16)
    release_packs(model)
    rule = PackRule()
    small_rows.allow_row_packs(False)
    _, plain = pack_bytes(model, rule)
    small_rows.allow_row_packs(True)
    _, with_rows = pack_bytes(model, rule)
    assert with_rows > plain > 0
    # room (what sizing leaves free, times the packs' share) between the two: oneDNN's copies fit, not both
    share = (1 - CPU_MEMORY_PERCENT) * step_options.PACK_MEMORY_SHARE
    monkeypatch.setattr(
        step_options, "free_memory_bytes", lambda device: int((plain + with_rows) / 2 / share)
    )
    try:
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            assert resolve_packed_linear(model, None, "cpu", None) is True
        assert small_rows.rows_module(torch.bfloat16) is None  # packs made now get no row pack
        assert any("small-row" in r.getMessage() for r in caplog.records if r.name == LOGGER)
        monkeypatch.setattr(step_options, "free_memory_bytes", lambda device: 1 << 40)
        assert resolve_packed_linear(model, None, "cpu", None) is True
        assert small_rows.rows_module(torch.bfloat16) is not None  # the next model's check decides anew
    finally:
        small_rows.allow_row_packs(True)


def test_packs_that_do_not_fit_fall_back_with_one_warning(monkeypatch, caplog) -> None:
    monkeypatch.setattr(step_options, "free_memory_bytes", lambda device: 1024)
    model = tiny_llama()
    release_packs(model)
    assert packed_linear_available(torch.float32, "cpu")  # its self-test's pack counted before
    before = PACKS.builds
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        first = generate_packed(model, ContinuousBatchingConfig(page_size=16))
        generate_packed(model, ContinuousBatchingConfig(page_size=16))
    warnings = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(warnings) == 1 and "MiB" in warnings[0], warnings
    assert PACKS.builds == before
    assert_like_generate(model, first)
    assert resolve_packed_linear(model, False, "cpu", None) is False


# -- bf16 where oneDNN refuses it: weights packed in float32 ------------------------------------------------


def test_a_bf16_weight_is_packed_in_float32_where_onednn_refuses_bf16(monkeypatch) -> None:
    """An AVX2-only CPU: oneDNN has no bf16 path and torch's own bf16 product is a generic loop, so a bf16
    weight is packed in float32 and its products widen the rows, sum in float32 and round once to bf16 (as
    oneDNN's bf16 product rounds): oneDNN's float32 product and, for a few rows, the float32 small-row one."""
    monkeypatch.setattr(packed_linear_module, "_onednn_refuses_bf16", lambda: True)
    calls: list[torch.dtype] = []
    f32_ops = small_rows.rows_module(torch.float32)
    if f32_ops is not None:

        class Counting:
            def f32_rows_matmul(self, x, packed, bias, out_features) -> torch.Tensor:
                calls.append(x.dtype)
                return f32_ops.f32_rows_matmul(x, packed, bias, out_features)

            def f32_rows_lanes(self) -> int:
                return small_rows._lanes(f32_ops)

        monkeypatch.setitem(small_rows._found, torch.float32, Counting())
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(96, 64, generator=generator).to(torch.bfloat16)
    bias = torch.randn(96, generator=generator).to(torch.bfloat16)
    assert packed_linear_module.pack_dtype(torch.bfloat16) == torch.float32
    handle = PACKS.new_handle()
    try:
        for rows in (1, 3, 40):
            x = torch.randn(1, rows, 64, generator=generator).to(torch.bfloat16)
            got = packed_linear(x, weight, bias, handle)
            assert got.dtype == torch.bfloat16 and got.shape == (1, rows, 96)
            exact = x.double() @ weight.double().T + bias.double()
            magnitude = x.double().abs() @ weight.double().abs().T + bias.double().abs()
            # float32 sums (off by their own rounding) rounded once to bf16 (half a step: 2^-9 relative)
            assert ((got.double() - exact).abs() <= exact.abs() * 2**-8 + magnitude * 65 * 2**-23).all()
        pack = PACKS._packs[handle]
        assert pack is not None and pack.packed.dtype == torch.float32
        if f32_ops is not None:
            assert calls and all(dtype == torch.float32 for dtype in calls), (
                "few rows: the float32 row product"
            )
        copies = 2 if pack.rows_pack is not None else 1  # the memory check counts float32 copies
        assert _pack_size(weight, weight.shape[0]) == weight.numel() * 4 * copies
    finally:
        PACKS.drop(handle)


def test_a_bf16_run_on_float32_packs_is_like_generate(monkeypatch) -> None:
    """The widened bf16 products through a whole run (the direct layer step's products included): greedy
    tokens equal `generate()`'s but at near-ties, as bf16 runs are judged."""
    monkeypatch.setattr(packed_linear_module, "_onednn_refuses_bf16", lambda: True)
    monkeypatch.setenv(RULE_ENV, "all")
    model = sharpen_attention(tiny_llama()).to(torch.bfloat16)  # peaked attention: a wrong row shows
    prompts = prompts_of_lengths([5, 17, 30], seed=6)
    outputs = model.generate_batch(
        prompts,
        max_new_tokens=8,
        continuous_batching_config=ContinuousBatchingConfig(page_size=16, packed_linear=True),
        progress_bar=False,
    )
    assert any(pack is not None and pack.packed.dtype == torch.float32 for pack in PACKS._packs.values()), (
        "no bf16 weight was packed in float32"
    )
    for i, prompt in enumerate(prompts):
        tokens = outputs[f"req_{i}"].generated_tokens
        mismatch = compare_tokens(model, f"req_{i}", prompt, greedy_reference(model, prompt, 8), tokens)
        assert mismatch is None or mismatch.is_near_tie, mismatch.describe()
