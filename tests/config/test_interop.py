"""transformers' own continuous-batching objects as inputs: configs, workload hints, statuses, and
every public parameter of transformers' API."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import warnings

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation import ContinuousBatchingConfig as HFConfig
from transformers.generation.continuous_batching import ContinuousBatchingManager as HFManager
from transformers.generation.continuous_batching import RequestStatus as HFStatus
from transformers.generation.continuous_batching.continuous_api import ContinuousMixin
from transformers.generation.continuous_batching.utils import WorkloadHints as HFHints

import transformers_cb
from tests.support.models import tiny_llama, tiny_llama_without_eos
from tests.support.prompts import prompts_of_lengths
from tests.support.reference import greedy_reference
from tests.support.threads import TIMEOUT
from transformers_cb import ContinuousBatchingConfig, ContinuousBatchingManager, RequestStatus
from transformers_cb.api.generate_batch import CACHED_ENGINE_ATTR
from transformers_cb.api.model_methods import CACHED_MANAGER_ATTR
from transformers_cb.config.interop import as_cb_config, from_transformers_config

GREEDY = GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0)


@pytest.fixture(scope="module")
def model():
    return tiny_llama_without_eos()


@pytest.fixture(scope="module")
def prompts():
    return prompts_of_lengths([4, 9, 13], seed=5)


def _check_greedy(model, prompts, out, max_new_tokens: int = 5) -> None:
    assert list(out) == [f"req_{i}" for i in range(len(prompts))]
    for i, prompt in enumerate(prompts):
        assert out[f"req_{i}"].generated_tokens == greedy_reference(model, prompt, max_new_tokens)


# -- config conversion ------------------------------------------------------------------------


def test_default_transformers_config_converts_to_our_defaults() -> None:
    assert from_transformers_config(HFConfig()) == ContinuousBatchingConfig()


# Fields set explicitly on transformers' config, carried over as they are.
CARRIED = {
    "page_size": 64,
    "num_blocks": 40,
    "max_batch_tokens": 300,
    "max_memory_percent": 0.5,
    "max_requests_per_batch": 7,
    "scheduler_type": "prefill_first",
    "safety_margin": 0.1,
    "return_logprobs": True,
    "seed": 3,
    "max_queue_size": 9,
    "allow_block_sharing": False,
    "cpu_group_timeout": None,
    "kv_padding_interval_size": 128,
    "use_cuda_graph": False,
    "use_async_batching": False,
}


def test_explicit_fields_are_carried_and_auto_values_mapped() -> None:
    # q_padding_interval_size=0 is transformers' "preset": our default is kept.
    theirs = HFConfig(**CARRIED, q_padding_interval_size=0)
    ours = as_cb_config(theirs)
    assert isinstance(ours, ContinuousBatchingConfig)
    expected = ContinuousBatchingConfig(**CARRIED)
    assert ours == expected
    assert theirs.page_size == 64 and theirs.q_padding_interval_size == 0  # not mutated


def test_deprecated_block_size_on_transformers_config_becomes_page_size() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # folded once by transformers, not warned again
        ours = as_cb_config(HFConfig(block_size=128))
    assert ours.page_size == 128 and ours.block_size is None


def test_invalid_value_in_transformers_config_gets_our_error() -> None:
    with pytest.raises(ValueError, match=r"ContinuousBatchingConfig\.page_size=2 is invalid"):
        as_cb_config(HFConfig(page_size=2))
    with pytest.raises(ValueError, match="scheduler_type"):
        as_cb_config(HFConfig(scheduler_type="lifo"))


def test_cpu_offload_space_is_carried_over() -> None:
    assert as_cb_config(HFConfig(cpu_offload_space=8.0)).cpu_offload_space == 8.0


def test_unknown_field_is_refused_by_name() -> None:
    extended = dataclasses.make_dataclass(
        "ContinuousBatchingConfig", [("warp_speed", int, 0)], bases=(HFConfig,)
    )
    extended.__module__ = "transformers.generation.future"
    with pytest.raises(ValueError, match="warp_speed"):
        as_cb_config(extended(warp_speed=9))
    assert as_cb_config(extended()) == ContinuousBatchingConfig()  # left at its default: ignored


def test_wrong_type_is_refused() -> None:
    with pytest.raises(TypeError, match="continuous_batching_config"):
        as_cb_config(42)


def test_gpu_only_options_warn_and_turn_off_on_cpu(model, prompts, caplog) -> None:
    theirs = HFConfig(use_cuda_graph=True, use_async_batching=True, q_padding_interval_size=32)
    with caplog.at_level(logging.WARNING, logger="transformers_cb"):
        out = model.generate_batch(prompts, GREEDY, continuous_batching_config=theirs, progress_bar=False)
    _check_greedy(model, prompts, out)
    assert "use_cuda_graph" in caplog.text and "use_async_batching" in caplog.text
    assert theirs.use_cuda_graph is True  # the caller's object is untouched


def test_transformers_config_accepted_everywhere(model, prompts) -> None:
    theirs = HFConfig(max_batch_tokens=256, max_requests_per_batch=3)
    _check_greedy(model, prompts, model.generate_batch(prompts, GREEDY, continuous_batching_config=theirs))
    manager = model.init_continuous_batching(GREEDY, continuous_batching_config=theirs)
    assert manager.engine.settings.config.max_requests_per_batch == 3
    manager.destroy()
    with model.continuous_batching_context_manager(GREEDY, continuous_batching_config=theirs) as manager:
        rid = manager.add_request(prompts[0], max_new_tokens=5)
        assert manager.get_result(rid, timeout=TIMEOUT).generated_tokens == greedy_reference(
            model, prompts[0], 5
        )
    direct = ContinuousBatchingManager(model, GREEDY, theirs)
    assert direct.engine.settings.config.max_batch_tokens == 256
    direct.destroy()


def test_nested_config_warns_and_explicit_one_wins_unvalidated(model, prompts) -> None:
    nested = GenerationConfig(**GREEDY.to_dict())
    nested.continuous_batching_config = HFConfig(max_batch_tokens=300)
    with pytest.warns(FutureWarning, match="deprecated"):
        out = model.generate_batch(prompts, nested, progress_bar=False)
    _check_greedy(model, prompts, out)
    invalid = GenerationConfig(**GREEDY.to_dict())
    invalid.continuous_batching_config = HFConfig(page_size=1)  # invalid, but overridden below
    with pytest.warns(FutureWarning):
        out = model.generate_batch(
            prompts, invalid, continuous_batching_config=ContinuousBatchingConfig(), progress_bar=False
        )
    _check_greedy(model, prompts, out)
    with pytest.warns(FutureWarning), pytest.raises(ValueError, match="page_size"):
        model.generate_batch(prompts, invalid, progress_bar=False)


# -- statuses ---------------------------------------------------------------------------------


def test_shared_statuses_compare_equal_to_transformers() -> None:
    for theirs in HFStatus:
        assert RequestStatus[theirs.name] == theirs
        assert (RequestStatus[theirs.name] >= HFStatus.FINISHED) == (theirs >= HFStatus.FINISHED)
        assert (RequestStatus[theirs.name] >= RequestStatus.FINISHED) == (theirs >= RequestStatus.FINISHED)


def test_our_own_statuses_equal_no_transformers_member() -> None:
    for ours in (RequestStatus.CANCELLED, RequestStatus.EVICTED):
        assert all(ours != theirs for theirs in HFStatus)
    assert RequestStatus.CANCELLED >= HFStatus.FINISHED  # over
    assert not RequestStatus.EVICTED >= HFStatus.FINISHED  # waiting to run again
    assert RequestStatus.EVICTED.user_visible is RequestStatus.PENDING


def test_outputs_never_show_evicted() -> None:
    from transformers_cb.requests import Request

    request = Request(request_id="r", prompt_ids=[1, 2], max_new_tokens=2)
    request.set_status(RequestStatus.PREFILLING)
    request.set_status(RequestStatus.EVICTED)
    assert request.to_output().status is RequestStatus.PENDING


# -- the public parameters of transformers' API -----------------------------------------------


def _public_parameters(function) -> set[str]:
    return {
        name
        for name, p in inspect.signature(function).parameters.items()
        if name != "self" and not name.startswith("_")
    }


@pytest.mark.parametrize(
    ("theirs", "ours"),
    [
        (ContinuousMixin.generate_batch, transformers_cb.api.generate_batch.generate_batch),
        (
            ContinuousMixin.init_continuous_batching,
            transformers_cb.api.model_methods.init_continuous_batching,
        ),
        (
            ContinuousMixin.continuous_batching_context_manager,
            transformers_cb.api.model_methods.continuous_batching_context_manager,
        ),
        (
            ContinuousMixin.destroy_cached_continuous_batching_manager,
            transformers_cb.api.model_methods.destroy_cached_continuous_batching_manager,
        ),
    ]
    + [
        (getattr(HFManager, name), getattr(ContinuousBatchingManager, name))
        for name, _ in inspect.getmembers(HFManager, inspect.isfunction)
        if not name.startswith("_") and name != "switch_to_cb_friendly_attn"
    ],
    ids=lambda f: getattr(f, "__qualname__", str(f)),
)
def test_every_public_parameter_of_transformers_is_accepted(theirs, ours) -> None:
    missing = _public_parameters(theirs) - _public_parameters(ours)
    assert not missing, f"{ours.__qualname__} lacks {sorted(missing)} of transformers' {theirs.__qualname__}"
    kinds = {p.kind for p in inspect.signature(theirs).parameters.values()}
    if inspect.Parameter.VAR_KEYWORD in kinds:
        assert inspect.Parameter.VAR_KEYWORD in {p.kind for p in inspect.signature(ours).parameters.values()}
    # Positional order of the shared leading parameters matches, so positional calls mean the same.
    shared = [n for n in inspect.signature(theirs).parameters if n in inspect.signature(ours).parameters]
    assert [n for n in inspect.signature(ours).parameters if n in shared] == shared


def test_every_config_field_of_transformers_is_accepted() -> None:
    ours = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    missing = {f.name for f in dataclasses.fields(HFConfig)} - ours
    assert not missing, f"ContinuousBatchingConfig lacks {sorted(missing)}"


def test_gpu_feature_manager_methods_exist_on_cpu_only_manager() -> None:
    # transformers exposes switch_to_cb_friendly_attn; ours switches inside the run (attention.selection).
    assert callable(ContinuousBatchingManager.warmup) and callable(ContinuousBatchingManager.join)


def test_deprecated_config_fields_warn_and_map() -> None:
    with pytest.warns(FutureWarning, match="max_cached_graphs"):
        # Deprecated in transformers; here it still bounds the CUDA graph cache.
        assert ContinuousBatchingConfig(max_cached_graphs=4).graph_cache_size == 4
    with pytest.warns(FutureWarning, match="use_default_compile_configs"):
        assert ContinuousBatchingConfig(use_default_compile_configs=False).default_compile_level == 0
    with pytest.warns(FutureWarning, match="use_default_compile_configs"):
        assert ContinuousBatchingConfig(use_default_compile_configs=True).default_compile_level == 3
    config = ContinuousBatchingConfig(drop_unsupported_processors=False, disable_nccl_graph_mixing=False)
    assert config.drop_unsupported_processors is False and config.disable_nccl_graph_mixing is False


# -- record_timestamps, warmup, persistence, hints, join -----------------------------------------


def test_record_timestamps_one_per_token(model, prompts) -> None:
    out = model.generate_batch(prompts, GREEDY, record_timestamps=True, progress_bar=False)
    for result in out.values():
        assert len(result.timestamps) == len(result.generated_tokens) == 5
        assert result.timestamps == sorted(result.timestamps)
        assert result.timestamps[0] == result.first_token_time
    assert all(
        r.timestamps is None for r in model.generate_batch(prompts, GREEDY, progress_bar=False).values()
    )
    with model.continuous_batching_context_manager(GREEDY) as manager:
        rid = manager.add_request(prompts[1], max_new_tokens=4, record_timestamps=True)
        assert len(manager.get_result(rid, timeout=TIMEOUT).timestamps) == 4


@pytest.mark.parametrize("warmup", [True, False])
def test_warmup_changes_no_output(model, prompts, warmup: bool) -> None:
    sampled = GenerationConfig(max_new_tokens=5, do_sample=True, top_k=0, eos_token_id=None, pad_token_id=0)
    config = ContinuousBatchingConfig(seed=7)
    _check_greedy(model, prompts, model.generate_batch(prompts, GREEDY, warmup=warmup, progress_bar=False))
    first = model.generate_batch(prompts, sampled, config, warmup=warmup, progress_bar=False)
    again = model.generate_batch(prompts, sampled, config, warmup=not warmup, progress_bar=False)
    assert [o.generated_tokens for o in first.values()] == [o.generated_tokens for o in again.values()]


def test_manager_warmup_runs_once_and_leaves_nothing(model, prompts) -> None:
    manager = model.init_continuous_batching(GREEDY)
    assert not manager.warmed_up
    manager.warmup()
    assert manager.warmed_up
    engine = manager.engine
    assert engine.counters.steps == 0 and engine.num_used_pages == 0
    assert engine.snapshot().prefix_cache_pages == 0 and manager.stats().prefix_cache_hit_rate == 0.0
    engine.check_integrity()
    manager.start()
    rid = manager.add_request(prompts[2], max_new_tokens=5)
    assert manager.get_result(rid, timeout=TIMEOUT).generated_tokens == greedy_reference(model, prompts[2], 5)
    manager.warmup()  # running: skipped with a warning, no effect
    manager.destroy()


def test_generate_batch_persistent_manager_reuses_the_engine(model, prompts) -> None:
    model.destroy_cached_continuous_batching_manager()
    first = model.generate_batch(prompts, GREEDY, persistent_manager=True, progress_bar=False)
    _, engine = getattr(model, CACHED_ENGINE_ATTR)
    second = model.generate_batch(prompts, GREEDY, persistent_manager=True, progress_bar=False)
    assert getattr(model, CACHED_ENGINE_ATTR)[1] is engine
    assert [o.generated_tokens for o in first.values()] == [o.generated_tokens for o in second.values()]
    _check_greedy(model, prompts, second)
    engine.check_integrity()
    other = GenerationConfig(max_new_tokens=3, do_sample=False, eos_token_id=None, pad_token_id=0)
    model.generate_batch(prompts, other, persistent_manager=True, progress_bar=False)
    assert getattr(model, CACHED_ENGINE_ATTR)[1] is not engine  # other configs: a new engine
    model.destroy_cached_continuous_batching_manager()
    assert getattr(model, CACHED_ENGINE_ATTR, None) is None


def test_stop_keep_for_next_session_caches_the_manager(model, prompts) -> None:
    manager = model.init_continuous_batching(GREEDY)
    manager.start()
    rid = manager.add_request(prompts[0], max_new_tokens=5)
    manager.stop(block=True, keep_for_next_session=True)
    assert getattr(model, CACHED_MANAGER_ATTR) is manager
    assert model.init_continuous_batching() is manager
    assert manager.get_result(rid, timeout=TIMEOUT).generated_tokens == greedy_reference(model, prompts[0], 5)
    model.destroy_cached_continuous_batching_manager()
    assert getattr(model, CACHED_MANAGER_ATTR, None) is None
    assert model.init_continuous_batching(GREEDY) is not manager


def test_join_waits_for_the_thread(model, prompts) -> None:
    import time

    manager = model.init_continuous_batching(GREEDY)
    manager.join(time.perf_counter())  # never started: returns at once
    manager.start()
    manager.add_request(prompts[0], max_new_tokens=5)
    manager.stop(block=False)
    manager.join(time.perf_counter(), timeout=TIMEOUT)
    assert not manager.is_running()
    manager.destroy()


@pytest.mark.parametrize("hints_cls", [HFHints, transformers_cb.config.interop.WorkloadHints])
def test_workload_hints_size_cache_and_block_tables(model, prompts, hints_cls) -> None:
    hints = hints_cls(max_prompt_length=20, max_generated_length=12, num_requests=3)
    config = ContinuousBatchingConfig(page_size=16)
    manager = model.init_continuous_batching(GREEDY, config, workload_hints=hints)
    engine = manager.engine
    assert engine.settings.sizing.max_requests_per_batch == 3
    assert engine.packer.block_tables[0].table.shape[1] == 2  # ceil(32 / 16) columns up front
    unhinted = model.init_continuous_batching(GREEDY, config)
    assert engine.settings.sizing.num_pages < unhinted.engine.settings.sizing.num_pages
    assert unhinted.engine.packer.block_tables[0].table.shape[1] == 512 // 16
    unhinted.destroy()
    with model.continuous_batching_context_manager(GREEDY, config, workload_hints=hints) as ctx:
        long_prompt = prompts_of_lengths([60], seed=1)[0]  # longer than the hint: rows widen on demand
        rid = ctx.add_request(long_prompt, max_new_tokens=5)
        assert ctx.get_result(rid, timeout=TIMEOUT).generated_tokens == greedy_reference(
            model, long_prompt, 5
        )
    manager.destroy()
    with pytest.raises(ValueError, match="num_requests"):
        transformers_cb.config.interop.as_workload_hints({"max_prompt_length": 1, "num_requests": -1})


# -- TRL's way of calling generate_batch -------------------------------------------------------


def test_trl_style_rollout_matches_generate() -> None:
    """As TRL's GRPOTrainer(use_transformers_paged=True): transformers' config with only
    max_memory_percent, each prompt repeated num_generations times, progress_bar=False, outputs read
    in input order with the eos kept."""
    model = tiny_llama(seed=3)
    prompts = prompts_of_lengths([6, 11, 3], seed=9, low=8)
    eos = greedy_reference(model, prompts[1], 8, eos_token_id=[])[5]  # a token greedy decoding does emit
    model.generation_config.eos_token_id = eos
    num_generations = 4
    batch = [prompt for prompt in prompts for _ in range(num_generations)]
    gen_config = GenerationConfig(
        max_new_tokens=24, do_sample=False, pad_token_id=0, bos_token_id=1, eos_token_id=eos
    )
    with torch.no_grad():
        outputs = model.generate_batch(
            batch,
            generation_config=gen_config,
            continuous_batching_config=HFConfig(max_memory_percent=0.5),
            progress_bar=False,
        )
    completions = [output.generated_tokens for output in outputs.values()]
    assert len(completions) == len(batch)
    for prompt, completion in zip(batch, completions, strict=True):
        assert completion == greedy_reference(model, prompt, 24, eos_token_id=eos)
    assert any(c[-1] == eos for c in completions), "choose seeds so some completion ends on eos"


def test_cli_python_api_takes_transformers_config(model, prompts) -> None:
    from transformers_cb.cli.main import generate_all

    outputs = generate_all(
        model,
        prompts,
        [5] * len(prompts),
        eos_token_id=None,
        pad_token_id=0,
        cb_config=HFConfig(max_batch_tokens=256, page_size=16),
        progress_bar=False,
    )
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.generated_tokens == greedy_reference(model, prompt, 5)


def test_max_cached_graphs_from_transformers_config_bounds_our_graph_cache() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers warns about the deprecated field itself
        theirs = HFConfig(max_cached_graphs=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # not warned a second time by ours
        assert as_cb_config(theirs).graph_cache_size == 3
