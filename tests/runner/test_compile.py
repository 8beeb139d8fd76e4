"""`default_compile_level` / `varlen_compile_config` / `decode_compile_config`: the settings, and a compiled run
on CPU (inductor with the system C++ compiler) that matches `generate()`."""

from __future__ import annotations

import pytest
import torch
from transformers import CompileConfig, GenerationConfig

from tests.support.engine import run_prompts
from tests.support.models import tiny_llama
from tests.support.prompts import prompts_of_lengths
from tests.support.reference import greedy_reference
from transformers_cb import ContinuousBatchingConfig
from transformers_cb.attention.native.kernel import native_module
from transformers_cb.engine.build import build_engine
from transformers_cb.runner.forward.compiling import (
    DECODE,
    VARLEN,
    CompileSettings,
    PathForwards,
    level_compile_config,
    resolve_compile_settings,
)


@pytest.mark.parametrize(
    ("level", "mode", "dynamic"),
    [
        (1, "default", True),
        (2, "max-autotune-no-cudagraphs", True),
        (3, "max-autotune-no-cudagraphs", False),
    ],
)
def test_levels_follow_the_documented_table(level: int, mode: str, dynamic: bool) -> None:
    config = level_compile_config(level)
    assert (config.mode, config.dynamic, config.fullgraph) == (mode, dynamic, False)
    settings = resolve_compile_settings(
        ContinuousBatchingConfig(default_compile_level=level), None, is_flash=False
    )
    assert settings.varlen.to_dict() == settings.decode.to_dict() == config.to_dict()


def test_level_zero_compiles_nothing_unless_a_config_says_so() -> None:
    assert level_compile_config(0) is None
    settings = resolve_compile_settings(ContinuousBatchingConfig(), GenerationConfig(), is_flash=False)
    assert settings.varlen is None and settings.decode is None
    # The generation config's compile_config is the last fallback (as in transformers).
    fallback = CompileConfig(mode="default", dynamic=True)
    generation_config = GenerationConfig(compile_config=fallback)
    settings = resolve_compile_settings(ContinuousBatchingConfig(), generation_config, is_flash=False)
    assert settings.varlen is fallback and settings.decode is fallback


def test_path_configs_take_precedence_over_the_level() -> None:
    varlen = CompileConfig(mode="default", dynamic=False)
    config = ContinuousBatchingConfig(default_compile_level=3, varlen_compile_config=varlen)
    settings = resolve_compile_settings(config, None, is_flash=False)
    assert settings.for_path(VARLEN) is varlen
    assert settings.for_path(DECODE).to_dict() == level_compile_config(3).to_dict()
    decode = ContinuousBatchingConfig(decode_compile_config={"mode": "default"})
    settings = resolve_compile_settings(decode, None, is_flash=False)
    assert settings.decode.mode == "default" and settings.varlen is None


def test_flash_varlen_path_is_not_compiled_by_the_level() -> None:
    """The documents: with flash attention the level applies to the decode path only."""
    settings = resolve_compile_settings(
        ContinuousBatchingConfig(default_compile_level=1), None, is_flash=True
    )
    assert settings.varlen is None and settings.decode is not None
    explicit = CompileConfig(mode="default")
    config = ContinuousBatchingConfig(default_compile_level=1, varlen_compile_config=explicit)
    assert resolve_compile_settings(config, None, is_flash=True).varlen is explicit


@pytest.mark.slow  # inductor compiles on the CPU: over 30 s on a quiet machine
def test_compiled_run_on_cpu_matches_generate_in_one_graph_per_path() -> None:
    """Level 1 on CPU: both paths run through torch.compile'd forwards and the tokens equal generate().
    With the native kernel every step of these prompts is native-only: each path is one graph (the paged
    attention custom op is inside it, no break), and batches of other sizes (one row, more rows, longer
    block tables) reuse the graphs: `compiled_graphs` stays flat after the first batch. (One test: a second
    would compile the same graphs again, ~20 s of a worker on a cold cache.)"""
    torch._dynamo.reset()
    model = tiny_llama()
    generation_config = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    config = ContinuousBatchingConfig(default_compile_level=1, page_size=16, max_batch_tokens=16)
    engine = build_engine(model, generation_config, config)
    batches = (([9, 3, 21], 5), ([30], 6), ([5, 7, 33], 7), ([2, 40, 11, 3, 3], 8))
    native = native_module() is not None
    counts = []
    for lengths, seed in batches if native else batches[:1]:
        prompts = prompts_of_lengths(lengths, seed=seed)
        requests = run_prompts(engine, model, prompts)
        for request, prompt in zip(requests, prompts, strict=True):
            assert request.generated_ids == greedy_reference(model, prompt, 6)
        counts.append(engine.snapshot().compiled_graphs)
    assert set(engine.runner.forwards.compiled_paths) == {VARLEN, DECODE}
    if native:
        # Both paths share one config, so one graph (dynamo caches per code object) or one per path.
        assert counts[0] in (1, 2) and counts == [counts[0]] * 4


def test_one_token_steps_take_the_eager_forward() -> None:
    """A compiled one-token step would be a graph of its own (sizes of 1 specialise): it runs eagerly."""
    model = tiny_llama()
    forwards = PathForwards(model, CompileSettings(decode=level_compile_config(1)))
    assert forwards(DECODE, 1) == model.forward
    assert forwards(DECODE, 3) != model.forward  # compiled (lazily: nothing compiles until it is called)
    assert forwards(VARLEN, 3) == model.forward  # no config for this path
    assert forwards.graphs_compiled == 0
