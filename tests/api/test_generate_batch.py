"""generate_batch behaviour beyond parity: grad modes, progress bar, per-request limits, logprobs,
sampling reproducibility, CPU defaults."""

from __future__ import annotations

import time

import pytest
import torch
from transformers import GenerationConfig

import transformers_cb
from tests.support.models import tiny_llama_without_eos
from tests.support.prompts import prompts_of_lengths
from tests.support.reference import greedy_reference
from transformers_cb import ContinuousBatchingConfig, RequestStatus
from transformers_cb.api.generate_batch import CACHED_ENGINE_ATTR
from transformers_cb.engine.build import build_engine
from transformers_cb.engine.intake.submission import Submission

GREEDY = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)


@pytest.fixture(scope="module")
def model():
    return tiny_llama_without_eos()


@pytest.fixture(scope="module")
def prompts():
    return prompts_of_lengths([5, 17, 1, 30], seed=11)


@pytest.mark.parametrize("mode", ["inference_mode", "no_grad", "grad"])
def test_works_under_every_grad_mode(model, prompts, mode: str) -> None:
    context = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad, "grad": torch.enable_grad}[
        mode
    ]
    with context():
        out = model.generate_batch(prompts, GREEDY, progress_bar=False)
    for i, prompt in enumerate(prompts):
        assert out[f"req_{i}"].generated_tokens == greedy_reference(model, prompt, 6)


def test_progress_bar_counts_requests_and_tokens_per_second(model, prompts, capsys) -> None:
    model.generate_batch(prompts, GREEDY, progress_bar=True)
    err = capsys.readouterr().err
    assert f"{len(prompts)}/{len(prompts)}" in err
    assert "tok_s" in err


def test_per_request_max_new_tokens_list(model, prompts) -> None:
    limits = [1, 4, 7, 2]
    out = model.generate_batch(prompts, GREEDY, progress_bar=False, max_new_tokens=limits)
    for i, (prompt, limit) in enumerate(zip(prompts, limits, strict=True)):
        result = out[f"req_{i}"]
        assert result.generated_tokens == greedy_reference(model, prompt, limit)
        assert result.finish_reason == "length"
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate_batch(prompts, GREEDY, progress_bar=False, max_new_tokens=[1, 2])


def test_eos_token_id_kwarg_stops_like_generate(model, prompts) -> None:
    reference = greedy_reference(model, prompts[1], 6)
    eos = reference[2]
    out = model.generate_batch(prompts[1:2], GREEDY, progress_bar=False, eos_token_id=[eos, 299])
    assert out["req_0"].generated_tokens == greedy_reference(model, prompts[1], 6, eos_token_id=[eos, 299])
    assert out["req_0"].generated_tokens[-1] == eos
    assert out["req_0"].finish_reason == "stop"


def test_outputs_carry_status_and_timings(model, prompts) -> None:
    before = time.perf_counter()
    out = model.generate_batch(prompts, GREEDY, progress_bar=False)
    assert list(out) == [f"req_{i}" for i in range(len(prompts))]
    for i, result in enumerate(out.values()):
        assert result.request_id == f"req_{i}"
        assert result.prompt_ids == prompts[i]
        assert result.status == RequestStatus.FINISHED and result.error is None
        assert before <= result.created_time <= result.first_token_time <= result.finish_time
        assert result.ttft is not None and result.ttft >= 0


def test_logprobs_equal_log_softmax_of_generate_scores(model, prompts) -> None:
    config = ContinuousBatchingConfig(return_logprobs=True, page_size=16)
    out = model.generate_batch(prompts, GREEDY, config, progress_bar=False)
    for i, prompt in enumerate(prompts):
        ref = model.generate(
            torch.tensor([prompt]),
            generation_config=GREEDY,
            output_scores=True,
            return_dict_in_generate=True,
        )
        expected = [
            torch.log_softmax(score[0].float(), dim=-1)[token].item()
            for score, token in zip(ref.scores, ref.sequences[0, len(prompt) :], strict=True)
        ]
        assert out[f"req_{i}"].logprobs == pytest.approx(expected, abs=1e-4)


def test_sampling_is_reproducible_under_a_seed(model, prompts) -> None:
    config = GenerationConfig(max_new_tokens=8, do_sample=True, temperature=0.8, top_k=20, eos_token_id=None)
    runs = [
        model.generate_batch(prompts, config, ContinuousBatchingConfig(seed=seed), progress_bar=False)
        for seed in (3, 3, 4)
    ]
    tokens = [[r.generated_tokens for r in run.values()] for run in runs]
    assert tokens[0] == tokens[1]
    assert tokens[0] != tokens[2]
    assert all(len(t) == 8 for t in tokens[0])


def test_cpu_defaults_are_sized_to_the_work(model, prompts) -> None:
    workload = [len(p) + 6 for p in prompts]
    engine = build_engine(model, GREEDY, ContinuousBatchingConfig(page_size=16), workload=workload)
    needed = sum(-(-n // 16) for n in workload)
    assert engine.settings.sizing.num_pages == -(-needed // 0.85)  # + headroom for fifo's safety margin
    assert engine.settings.sizing.max_requests_per_batch == len(prompts)
    assert engine.settings.sizing.max_batch_tokens == 8192
    assert engine.cache.nbytes() < 2**20


def test_generate_batch_is_our_function_and_uninstall_restores(model) -> None:
    assert type(model).generate_batch.__module__ == "transformers_cb.api.generate_batch"
    transformers_cb.uninstall()
    try:
        assert type(model).generate_batch.__module__ != "transformers_cb.api.generate_batch"
    finally:
        transformers_cb.install()
    assert type(model).generate_batch.__module__ == "transformers_cb.api.generate_batch"


def test_a_job_that_fits_is_admitted_at_once(model) -> None:
    """Regression: a cache sized exactly to the work made the safety margin hold back the last
    requests until the first ones finished (twice the steps on long decodes)."""
    prompts = prompts_of_lengths([20 + i for i in range(16)], seed=5)
    workload = [len(p) + 64 for p in prompts]
    # One page of 256 per request: exactly 16 pages would admit only 14 under a 0.15 margin.
    engine = build_engine(model, GREEDY, ContinuousBatchingConfig(), workload=workload)
    for i, prompt in enumerate(prompts):
        engine.add(engine.build_request(Submission(prompt, f"req_{i}", max_new_tokens=64)))
    with torch.inference_mode():
        engine.step()
    assert not engine.scheduler.waiting
    assert len(engine.scheduler.running) == len(prompts)


def _count_calls(monkeypatch, name: str, counted) -> list:
    """Count the calls of `transformers_cb.config.generation_fields.<name>` wherever the package imported
    it (`counted(args)` says whether a call counts)."""
    import sys

    from transformers_cb.config import generation_fields

    original, calls = getattr(generation_fields, name), []

    def counting(*args, **kwargs):
        if counted(args):
            calls.append(args)
        return original(*args, **kwargs)

    for module_name, module in list(sys.modules.items()):
        if module_name.startswith("transformers_cb") and getattr(module, name, None) is original:
            monkeypatch.setattr(module, name, counting)
    return calls


@pytest.mark.parametrize("persistent", [False, True])
def test_the_generation_config_is_resolved_once_and_each_limit_defaulted_once(
    model, prompts, monkeypatch, persistent: bool
) -> None:
    from transformers_cb.config.generation_fields import ResolvedConfig

    resolved = _count_calls(
        monkeypatch, "resolve_generation_config", lambda a: not isinstance(a[1], ResolvedConfig)
    )
    defaulted = _count_calls(monkeypatch, "default_max_new_tokens", lambda a: True)
    config = GenerationConfig(max_new_tokens=3, do_sample=False, eos_token_id=None)
    out = model.generate_batch(
        prompts, config, progress_bar=False, warmup=False, persistent_manager=persistent
    )
    model.destroy_cached_continuous_batching_manager()
    assert [len(o.generated_tokens) for o in out.values()] == [3] * len(prompts)
    assert len(resolved) == 1
    assert len(defaulted) == len(prompts)


def test_per_item_lists_split_one_way_in_generate_batch_and_add_requests(model, prompts) -> None:
    from transformers_cb.engine.intake.validation import per_item

    assert per_item(3, 2, "x") == [3, 3]
    assert per_item([1, 2], 2, "x") == [1, 2]
    assert per_item(("a", "b"), 2, "stop_strings", lists_are_values=True) == [("a", "b")] * 2
    with pytest.raises(ValueError, match="guided: got 3 values for 2 inputs") as batch_error:
        model.generate_batch(prompts[:2], GREEDY, progress_bar=False, guided=[None] * 3)
    manager = model.init_continuous_batching(generation_config=GREEDY)
    try:
        with pytest.raises(ValueError, match="guided: got 3 values for 2 inputs") as manager_error:
            manager.add_requests(prompts[:2], guided=[None] * 3)
    finally:
        manager.destroy()
    assert str(batch_error.value) == str(manager_error.value)


def test_a_persistent_engine_hits_no_prefix_page_computed_with_older_weights() -> None:
    """An in-place weight update between two persistent calls (an optimizer step, TRL's weight sync) must
    change the outputs exactly as it changes `generate()`'s: the cached prefix pages hold the old K/V."""
    model = tiny_llama_without_eos()
    prompts = prompts_of_lengths([40, 40, 24], seed=3)
    config = GenerationConfig(max_new_tokens=6, do_sample=False)
    cb_config = ContinuousBatchingConfig(page_size=8, num_blocks=64)

    def run() -> list[list[int]]:
        outputs = model.generate_batch(
            prompts, config, cb_config, progress_bar=False, warmup=False, persistent_manager=True
        )
        return [outputs[f"req_{i}"].generated_tokens for i in range(len(prompts))]

    try:
        run()
        engine = getattr(model, CACHED_ENGINE_ATTR)[1]
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.k_proj.weight.mul_(-1.5)
        second = run()
        assert getattr(model, CACHED_ENGINE_ATTR)[1] is engine  # the same engine, reused
        assert second == [greedy_reference(model, prompt, 6) for prompt in prompts]
        assert engine.snapshot().prefix.hit_tokens == 0  # nothing of the old weights' pages was hit
        third = run()  # unchanged weights: the pages of the second call are hit again
        assert third == second and engine.snapshot().prefix.hit_tokens > 0
    finally:
        model.destroy_cached_continuous_batching_manager()


@pytest.mark.parametrize("captures", [False, True])
def test_generate_batch_warms_up_only_where_a_warmup_captures_something(
    model, prompts, monkeypatch, captures: bool
) -> None:
    """transformers' `warmup=` pre-captures CUDA graphs (or compiles); an eager CPU run has nothing to
    capture, and a throw-away request there only costs time (~20 ms a call on the small benchmark model)."""
    from transformers_cb.engine.engine import Engine

    warmups: list[Engine] = []
    original = Engine.warmup

    def recording(self: Engine, *args, **kwargs) -> bool:
        warmups.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Engine, "warmup", recording)
    monkeypatch.setattr(Engine, "warmup_captures", property(lambda self: captures))
    out = model.generate_batch(prompts, GREEDY, progress_bar=False)
    assert [o.generated_tokens for o in out.values()] == [greedy_reference(model, p, 6) for p in prompts]
    assert len(warmups) == int(captures)
    monkeypatch.undo()
    engine = build_engine(model, GREEDY, ContinuousBatchingConfig())
    assert not engine.warmup_captures  # a CPU model, eager: nothing to capture
