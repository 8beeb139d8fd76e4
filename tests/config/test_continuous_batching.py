"""ContinuousBatchingConfig validation and defaults, sizing, and what generate_batch may not mutate."""

from __future__ import annotations

import copy
import dataclasses
import re
import warnings

import pytest
import torch
from transformers import CompileConfig, GenerationConfig

from tests.support.models import TINY_SHAPE, tiny_llama
from tests.support.prompts import prompts_of_lengths
from transformers_cb import ContinuousBatchingConfig
from transformers_cb.api import generate_batch as generation_module
from transformers_cb.config.generation_fields import resolve_generation_config
from transformers_cb.memory import sizing
from transformers_cb.memory.sizing import ModelShape, resolve_sizing

CPU = torch.device("cpu")
GiB = 2**30


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


# -- defaults ------------------------------------------------------------------------------------


def test_defaults_match_the_spec() -> None:
    config = ContinuousBatchingConfig()
    assert config.page_size == 256
    assert config.num_blocks is None
    assert config.max_memory_percent is None
    assert config.max_batch_tokens is None
    assert config.max_requests_per_batch is None
    assert config.scheduler_type == "fifo"
    assert config.safety_margin is None
    assert config.resolved_safety_margin == 0.15
    assert config.allow_block_sharing is True
    assert config.cpu_offload_space == 0.0
    assert config.cpu_offload_space_safety_threshold == 0.8
    assert config.return_logprobs is False
    assert config.per_request_processors is False
    assert config.use_cuda_graph in (None, False)
    assert config.use_async_batching is False
    assert config.default_compile_level == 0
    assert config.varlen_compile_config is None
    assert config.decode_compile_config is None
    assert config.max_blocks_per_request is None
    assert config.auto_switch_to_flash is True
    assert config.cpu_group_timeout == 300.0
    assert config.seed is None
    assert config.max_queue_size == 0
    assert dataclasses.is_dataclass(config)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, 0.15),
        ({"scheduler_type": "fifo"}, 0.15),
        ({"scheduler_type": "prefill_first"}, 0.0),
        ({"scheduler_type": "prefill_first", "safety_margin": 0.3}, 0.3),
        ({"scheduler_type": "fifo", "safety_margin": 0}, 0.0),
        ({"safety_margin": 1}, 1.0),
    ],
)
def test_resolved_safety_margin(kwargs: dict, expected: float) -> None:
    config = ContinuousBatchingConfig(**kwargs)
    assert config.resolved_safety_margin == expected
    assert isinstance(config.resolved_safety_margin, float)


# -- invalid values ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("page_size", 3),
        ("page_size", 0),
        ("page_size", -16),
        ("page_size", "a"),
        ("page_size", 16.0),
        ("page_size", True),
        ("page_size", None),
        ("num_blocks", -1),
        ("num_blocks", 0),
        ("num_blocks", 2.5),
        ("max_batch_tokens", 0),
        ("max_batch_tokens", -5),
        ("max_batch_tokens", "256"),
        ("max_requests_per_batch", 0),
        ("max_memory_percent", 0),
        ("max_memory_percent", 1.5),
        ("max_memory_percent", -0.1),
        ("max_memory_percent", "half"),
        ("scheduler_type", "lifo"),
        ("scheduler_type", None),
        ("safety_margin", 1.5),
        ("safety_margin", -0.1),
        ("safety_margin", "0.1"),
        ("cpu_offload_space", -1.0),
        ("cpu_offload_space_safety_threshold", 0),
        ("cpu_offload_space_safety_threshold", 1.2),
        ("q_padding_interval_size", -1),
        ("use_cuda_graph", (True,)),
        ("kv_padding_interval_size", -1),
        ("default_compile_level", 5),
        ("default_compile_level", -1),
        ("max_blocks_per_request", -1),
        ("cpu_group_timeout", 0),
        ("cpu_group_timeout", -3.0),
        ("seed", 1.5),
        ("seed", "7"),
        ("max_queue_size", -1),
        ("max_queue_size", 1.0),
        ("allow_block_sharing", "yes"),
        ("return_logprobs", 1),
        ("per_request_processors", None),
        ("use_async_batching", "no"),
        ("auto_switch_to_flash", 0),
        ("batch_invariant", None),
        ("batch_invariant", 1),
        ("use_cuda_graph", "auto"),
    ],
)
def test_invalid_value_names_field_and_value(field: str, value: object) -> None:
    with pytest.raises(ValueError) as info:
        ContinuousBatchingConfig(**{field: value})
    message = str(info.value)
    assert f"{field}=" in message
    assert repr(value) in message
    assert "allowed" in message


def test_copy_validates_and_leaves_the_original() -> None:
    config = ContinuousBatchingConfig(page_size=32)
    changed = config.copy(max_batch_tokens=512)
    assert (changed.page_size, changed.max_batch_tokens) == (32, 512)
    assert config.max_batch_tokens is None
    with pytest.raises(ValueError, match=re.escape("page_size=2")):
        config.copy(page_size=2)


def test_invalid_value_set_after_construction_is_caught_by_generate_batch(model) -> None:
    config = ContinuousBatchingConfig(page_size=16)
    config.page_size = 3
    with pytest.raises(ValueError, match=re.escape("page_size=3")):
        model.generate_batch([[5, 6]], GenerationConfig(max_new_tokens=2), config, progress_bar=False)


# -- deprecated alias and unbuilt features -------------------------------------------------------


def test_block_size_alias_warns_and_sets_page_size() -> None:
    with pytest.warns(FutureWarning, match="block_size is deprecated"):
        config = ContinuousBatchingConfig(block_size=32)
    assert config.page_size == 32
    assert config.block_size is None
    assert "block_size" not in repr(config)
    with pytest.warns(FutureWarning), pytest.raises(ValueError, match=re.escape("page_size=2")):
        ContinuousBatchingConfig(block_size=2)


def test_page_size_alone_does_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ContinuousBatchingConfig(page_size=64).page_size == 64


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("use_cuda_graph", False),
        ("use_cuda_graph", None),
        ("use_cuda_graph", True),
        ("use_cuda_graph", (True, False)),
        ("use_async_batching", True),
        ("use_async_batching", None),
        ("q_padding_interval_size", 0),
        ("max_blocks_per_request", 0),
        ("max_blocks_per_request", None),
        ("max_blocks_per_request", 64),
        ("cpu_offload_space", 0.0),
        ("cpu_offload_space", 0),
        ("cpu_offload_space", 8.0),  # built (issue 9): the host tier
        ("cpu_offload_space", None),
        ("cpu_offload_space_safety_threshold", 0.5),
        ("default_compile_level", 0),
        ("default_compile_level", 1),
        ("default_compile_level", 3),
        ("max_blocks_per_request", 1),
        ("per_request_processors", False),
        ("per_request_processors", True),
        ("use_async_batching", False),
        ("allow_block_sharing", False),
        ("auto_switch_to_flash", False),
        ("cpu_group_timeout", None),
        ("seed", 0),
    ],
)
def test_off_values_are_accepted(field: str, value: object) -> None:
    config = ContinuousBatchingConfig(**{field: value})
    assert getattr(config, field) == value


@pytest.mark.parametrize("field", ["varlen_compile_config", "decode_compile_config"])
def test_compile_configs_accept_dicts_and_compile_configs(field: str) -> None:
    from_dict = ContinuousBatchingConfig(**{field: {"mode": "default", "dynamic": True}})
    assert isinstance(getattr(from_dict, field), CompileConfig)
    assert getattr(from_dict, field).dynamic is True
    given = CompileConfig(mode="max-autotune-no-cudagraphs")
    assert getattr(ContinuousBatchingConfig(**{field: given}), field) is given
    with pytest.raises(ValueError, match=f"ContinuousBatchingConfig.{field}="):
        ContinuousBatchingConfig(**{field: "default"})


def test_boundary_values_are_accepted() -> None:
    config = ContinuousBatchingConfig(
        page_size=4,
        num_blocks=1,
        max_batch_tokens=1,
        max_requests_per_batch=1,
        max_memory_percent=1,
        safety_margin=0.0,
        scheduler_type="prefill_first",
        default_compile_level=0,
        max_queue_size=0,
    )
    assert config.page_size == 4
    assert ContinuousBatchingConfig(safety_margin=1.0).safety_margin == 1.0


# -- never mutating the caller's objects ---------------------------------------------------------


def test_generate_batch_does_not_mutate_configs(model) -> None:
    generation_config = GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=[2, 7])
    cb_config = ContinuousBatchingConfig(page_size=16, max_batch_tokens=32, return_logprobs=True)
    model_generation_config = model.generation_config.to_dict()
    gen_before = copy.deepcopy(generation_config.to_dict())
    cb_before = dataclasses.asdict(cb_config)
    outputs = model.generate_batch(
        prompts_of_lengths([7, 40, 3], seed=3), generation_config, cb_config, progress_bar=False
    )
    assert len(outputs) == 3
    assert all(
        o.logprobs is not None and len(o.logprobs) == len(o.generated_tokens) for o in outputs.values()
    )
    assert generation_config.to_dict() == gen_before
    assert dataclasses.asdict(cb_config) == cb_before
    assert model.generation_config.to_dict() == model_generation_config


def test_generate_batch_without_configs_does_not_mutate_the_model_generation_config(model) -> None:
    before = model.generation_config.to_dict()
    outputs = model.generate_batch([[5, 6, 7]], max_new_tokens=3, progress_bar=False)
    assert len(outputs["req_0"].generated_tokens) <= 3
    assert model.generation_config.to_dict() == before


# -- resolving the generation config like generate() ------------------------------------------------


@pytest.mark.parametrize(
    "user_config",
    [None, GenerationConfig(), GenerationConfig(max_new_tokens=3), GenerationConfig(do_sample=True)],
)
def test_generation_config_resolves_like_generate(model, user_config) -> None:
    resolved = resolve_generation_config(model, user_config)
    expected, _ = model._prepare_generation_config(copy.deepcopy(user_config))
    for name in ("do_sample", "top_k", "top_p", "temperature", "eos_token_id", "num_beams"):
        assert getattr(resolved, name) == getattr(expected, name), name
    assert resolved is not user_config
    assert resolved is not model.generation_config


@pytest.mark.parametrize(
    "user_config",
    [None, GenerationConfig(), GenerationConfig(max_length=15), GenerationConfig(max_new_tokens=3)],
    ids=["none", "empty", "max_length", "max_new_tokens"],
)
def test_stopping_length_matches_generate(model, user_config) -> None:
    """Without max_new_tokens, generate() reads the default max_length (20) as 20 new tokens,
    and a max_length the user set as the total length."""
    prompts = prompts_of_lengths([6, 12], seed=2)
    outputs = model.generate_batch(prompts, user_config, progress_bar=False)
    for i, prompt in enumerate(prompts):
        input_ids = torch.tensor([prompt])
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # generate()'s "model-agnostic default max_length" warning
            expected = model.generate(
                input_ids,
                generation_config=user_config,
                attention_mask=torch.ones_like(input_ids),
                pad_token_id=0,
            )
        assert outputs[f"req_{i}"].generated_tokens == expected[0, len(prompt) :].tolist()


# -- unsupported generation options and the deprecated path ----------------------------------------


@pytest.mark.parametrize(
    ("option", "value"),
    [("num_beams", 2), ("guidance_scale", 1.5), ("penalty_alpha", 0.6)],
)
def test_unsupported_generation_options_raise(model, option: str, value: object) -> None:
    kwargs = {option: value}
    generation_config = GenerationConfig(max_new_tokens=2, **kwargs)
    with pytest.raises(ValueError, match=re.escape(f"GenerationConfig.{option}={value!r}")):
        model.generate_batch([[5, 6]], generation_config, progress_bar=False)


def test_continuous_batching_config_on_generation_config_is_deprecated_but_works(model) -> None:
    legacy = ContinuousBatchingConfig(page_size=16, return_logprobs=True)
    with warnings.catch_warnings():
        # transformers itself may warn when the GenerationConfig is built; ours is checked below.
        warnings.simplefilter("ignore")
        generation_config = GenerationConfig(
            max_new_tokens=3, do_sample=False, continuous_batching_config=legacy
        )
    with pytest.warns(FutureWarning, match="continuous_batching_config= to generate_batch"):
        outputs = model.generate_batch([[5, 6, 7]], generation_config, progress_bar=False)
    output = outputs["req_0"]
    assert output.logprobs is not None, "the legacy config's return_logprobs must be honoured"
    assert len(output.logprobs) == len(output.generated_tokens)
    # An explicit argument wins over the legacy one (still warning).
    with pytest.warns(FutureWarning):
        outputs = model.generate_batch(
            [[5, 6, 7]], generation_config, ContinuousBatchingConfig(page_size=16), progress_bar=False
        )
    assert outputs["req_0"].logprobs is None
    assert outputs["req_0"].generated_tokens == output.generated_tokens


def test_legacy_config_as_a_dict(model) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        generation_config = GenerationConfig(
            max_new_tokens=2, continuous_batching_config={"page_size": 16, "return_logprobs": True}
        )
    with pytest.warns(FutureWarning, match="deprecated"):
        outputs = model.generate_batch([[5, 6, 7]], generation_config, progress_bar=False)
    assert outputs["req_0"].logprobs is not None


# -- sizing --------------------------------------------------------------------------------------

SHAPE = ModelShape(
    num_layers=TINY_SHAPE["num_hidden_layers"],
    num_kv_heads=TINY_SHAPE["num_key_value_heads"],
    head_dim=TINY_SHAPE["hidden_size"] // TINY_SHAPE["num_attention_heads"],
    hidden_size=TINY_SHAPE["hidden_size"],
    intermediate_size=TINY_SHAPE["intermediate_size"],
    vocab_size=TINY_SHAPE["vocab_size"],
    max_position_embeddings=TINY_SHAPE["max_position_embeddings"],
)


@pytest.fixture
def free_memory(monkeypatch):
    """Set the free memory `resolve_sizing` sees."""

    def set_free(num_bytes: int) -> None:
        monkeypatch.setattr(sizing, "free_memory_bytes", lambda device: num_bytes)

    return set_free


def test_model_shape_from_config(model) -> None:
    assert ModelShape.from_config(model.config) == SHAPE
    assert SHAPE.kv_bytes_per_token(4) == 2 * 2 * 2 * 16 * 4


def test_max_batch_tokens_defaults_to_8192_when_memory_allows(free_memory) -> None:
    free_memory(64 * GiB)
    resolved = resolve_sizing(ContinuousBatchingConfig(), SHAPE, CPU, torch.float32, workload=[10])
    assert resolved.max_batch_tokens == 8192


def test_max_batch_tokens_is_floored_at_256(free_memory) -> None:
    free_memory(2**20)  # 1 MiB: memory alone would allow a few dozen tokens
    resolved = resolve_sizing(ContinuousBatchingConfig(), SHAPE, CPU, torch.float32, workload=[10])
    assert resolved.max_batch_tokens == 256
    assert resolved.num_pages >= 1


def test_max_batch_tokens_is_capped_by_memory(free_memory) -> None:
    per_token = SHAPE.activation_bytes_per_token(4)
    # budget * 0.5 (CPU default) * 0.2 (batch share) / per_token = 1000 tokens
    free_memory(int(1000 * per_token / 0.5 / 0.2) + 100)
    resolved = resolve_sizing(ContinuousBatchingConfig(), SHAPE, CPU, torch.float32, workload=[10])
    assert resolved.max_batch_tokens == 1000


def test_explicit_values_are_kept(free_memory) -> None:
    free_memory(2**20)
    config = ContinuousBatchingConfig(
        page_size=16, max_batch_tokens=100, num_blocks=7, max_requests_per_batch=3
    )
    resolved = resolve_sizing(config, SHAPE, CPU, torch.float32, workload=[10] * 50)
    assert (resolved.max_batch_tokens, resolved.num_pages, resolved.max_requests_per_batch) == (100, 7, 3)
    assert resolved.page_size == 16
    assert resolved.max_pages_per_request == 7


def test_cpu_cache_is_sized_to_the_workload(free_memory) -> None:
    free_memory(64 * GiB)
    config = ContinuousBatchingConfig(page_size=16)
    workload = [10, 300, 40, 16, 17]
    resolved = resolve_sizing(config, SHAPE, CPU, torch.float32, workload=workload)
    # Every request at full length, plus headroom for fifo's 0.15 safety margin: ceil(26 / 0.85).
    assert resolved.num_pages == 31
    assert resolved.max_requests_per_batch == len(workload)
    assert resolved.max_pages_per_request == resolved.num_pages  # fewer pages than 512 / 16 = 32


def test_cpu_cache_without_workload_is_capped(free_memory) -> None:
    free_memory(64 * GiB)
    resolved = resolve_sizing(ContinuousBatchingConfig(), SHAPE, CPU, torch.float32, workload=None)
    assert resolved.num_pages == sizing.CPU_CACHE_CAP_BYTES // (SHAPE.kv_bytes_per_token(4) * 256)
    assert resolved.max_requests_per_batch == 1024
    assert resolved.max_pages_per_request == 2  # 512 positions / 256 tokens per page


def test_low_memory_still_fits_the_largest_request(free_memory) -> None:
    free_memory(2**20)
    config = ContinuousBatchingConfig(page_size=16)
    resolved = resolve_sizing(config, SHAPE, CPU, torch.float32, workload=[500, 20])
    assert resolved.num_pages >= 32  # ceil(500 / 16)


def test_max_requests_is_capped_by_the_token_budget(free_memory) -> None:
    free_memory(64 * GiB)
    config = ContinuousBatchingConfig(max_batch_tokens=300)
    resolved = resolve_sizing(config, SHAPE, CPU, torch.float32, workload=[4] * 500)
    assert resolved.max_requests_per_batch == 300


def test_generate_batch_sizes_from_its_prompts(model, monkeypatch) -> None:
    engines = []
    original = generation_module.build_engine

    def recording_build(*args, **kwargs):
        engines.append(original(*args, **kwargs))
        return engines[-1]

    monkeypatch.setattr(generation_module, "build_engine", recording_build)
    prompts = prompts_of_lengths([5, 20, 33], seed=1)
    model.generate_batch(
        prompts,
        GenerationConfig(max_new_tokens=4),
        ContinuousBatchingConfig(page_size=16),
        progress_bar=False,
    )
    (engine,) = engines
    assert engine.settings.sizing.max_requests_per_batch == 3
    assert engine.settings.sizing.max_batch_tokens == 8192
    # Each request at full length: 5 + 4, 20 + 4, 33 + 4 tokens -> 1 + 2 + 3 pages of 16,
    # plus headroom for the 0.15 safety margin: ceil(6 / 0.85) = 8.
    assert engine.settings.sizing.num_pages == 8
    assert engine.scheduler.safety_margin == 0.15
    assert engine.num_total_pages - engine.num_used_pages == 8


def test_explicit_decode_fast_path_falls_back_with_a_warning(caplog) -> None:
    """As the documents say: without flash_attn_with_kvcache the varlen path runs, and only an
    explicit `max_blocks_per_request` logs a warning."""
    import logging

    from transformers import GenerationConfig

    from tests.support.models import tiny_llama

    model = tiny_llama()
    generation_config = GenerationConfig(max_new_tokens=3, do_sample=False, eos_token_id=None)
    with caplog.at_level(logging.WARNING, logger="transformers_cb.engine.engine"):
        out = model.generate_batch(
            [[5, 6, 7]], generation_config, ContinuousBatchingConfig(), progress_bar=False
        )
    assert "fast path" not in caplog.text
    with caplog.at_level(logging.WARNING, logger="transformers_cb.engine.engine"):
        fallback = model.generate_batch(
            [[5, 6, 7]],
            generation_config,
            ContinuousBatchingConfig(max_blocks_per_request=64),
            progress_bar=False,
        )
    assert "fast path" in caplog.text
    assert fallback["req_0"].generated_tokens == out["req_0"].generated_tokens
