"""CUDA graphs and async batching: bucketing, padding, the LRU cache and what a padded row touches, on CPU
(the static steps run eagerly there: `capture=False`), and the capture itself on CUDA (skipped without).

Graphs replay static-shape kernels, i.e. the paged flash backends: these tests run them through the
flash-attn test double (tests/support/flash_double.py), whose no-host-sync form is what a capture records.
"""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import GenerationConfig

from tests.support import flash_double
from tests.support.engine import run_prompts
from tests.support.models import tiny_llama, tiny_llama_ignoring_logits_to_keep
from tests.support.prompts import prompts_of_lengths
from tests.support.reference import greedy_reference
from transformers_cb import ContinuousBatchingConfig
from transformers_cb.attention.backends.fast_path import prepare_flash_step
from transformers_cb.attention.backends.flash_kernels import FA2
from transformers_cb.attention.selection import paged_backend
from transformers_cb.config.continuous_batching import DeviceOptions, resolve_device_options
from transformers_cb.engine import settings as settings_module
from transformers_cb.engine.build import build_engine
from transformers_cb.engine.engine import Engine
from transformers_cb.engine.intake.submission import Submission
from transformers_cb.runner.forward.async_batching import BufferTurns
from transformers_cb.runner.forward.compiling import DECODE, VARLEN
from transformers_cb.runner.forward.cuda_graphs import GraphKey, LRUCache, padded_length

GREEDY = GenerationConfig(max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA device")


def _config(**changes) -> ContinuousBatchingConfig:
    base = {"page_size": 256, "num_blocks": 8, "max_batch_tokens": 32, "use_cuda_graph": True}
    return ContinuousBatchingConfig(**{**base, **changes})


def _as_configured(config: ContinuousBatchingConfig, device_type: str) -> DeviceOptions:
    """The GPU-only options as set, whatever the device."""
    graphs = config.cuda_graph_paths
    return DeviceOptions(graphs, bool(config.use_async_batching) and any(graphs))


@pytest.fixture
def graphs_on_cpu(monkeypatch):
    """Keep `use_cuda_graph` on for a CPU engine: its graph steps then run eagerly (no capture)."""
    if not CUDA:
        monkeypatch.setattr(settings_module, "resolve_device_options", _as_configured)
    with flash_double.injected(fa2=True) as calls:
        yield calls


def _run_matches_generate(engine: Engine, model) -> None:
    """Four ragged prompts through `engine`; each equals plain greedy `generate()` (run with sdpa)."""
    prompts = prompts_of_lengths([13, 2, 30, 7], seed=6)
    requests = run_prompts(engine, model, prompts)
    model.set_attn_implementation("sdpa")
    for request, prompt in zip(requests, prompts, strict=True):
        assert request.generated_ids == greedy_reference(model, prompt, 10)


# -- bucketing and the LRU cache -----------------------------------------------------------------


def test_padded_length_rounds_up_to_the_interval() -> None:
    assert [padded_length(n, 64) for n in (1, 63, 64, 65, 200)] == [64, 64, 64, 128, 256]
    assert padded_length(0, 16) == 16  # at least one interval


def test_lru_cache_drops_the_least_recently_used() -> None:
    cache = LRUCache(2)
    assert cache.put("a", 1) == [] and cache.put("b", 2) == []
    assert cache.get("a") == 1  # refreshes a
    assert cache.put("c", 3) == [2]  # b was the least recently used
    assert cache.ordered_keys() == ["a", "c"] and cache.get("b") is None
    with pytest.raises(ValueError, match="capacity"):
        LRUCache(0)


def test_steps_are_keyed_by_padded_query_and_kv_lengths(graphs_on_cpu) -> None:
    model = tiny_llama()
    model.set_attn_implementation(FA2)
    engine = build_engine(model, GREEDY, _config(q_padding_interval_size=8, kv_padding_interval_size=300))
    graphs = engine.runner.graphs
    engine.add(engine.build_request(Submission(list(range(3, 23)), "a")))
    step = engine.packer.pack(engine.scheduler.schedule())
    prepare_flash_step(step.metadata, engine.settings.step_options.max_blocks_per_request)
    # 20 tokens -> 24; KV 20 -> 300 -> 512 (whole pages of 256: the block table is page-granular)
    assert graphs.key_for(step, VARLEN) == GraphKey(VARLEN, 24, 512)
    assert graphs.key_for(step, DECODE) == GraphKey(DECODE, 24, 0)  # fixed table width: no KV bucket


# -- parity and what padding touches ---------------------------------------------------------------


def test_graph_steps_match_generate_and_stay_within_max_cached_graphs(graphs_on_cpu) -> None:
    model = tiny_llama()
    model.set_attn_implementation(FA2)
    config = _config(q_padding_interval_size=4, max_cached_graphs=2, max_batch_tokens=16)
    engine = build_engine(model, GREEDY, config)
    _run_matches_generate(engine, model)
    graphs = engine.runner.graphs
    assert graphs is not None and 1 <= len(graphs.graphs) <= 2
    paths = {key.path for key in graphs.graphs.ordered_keys()}
    assert DECODE in paths  # the decode fast path ran through its own bucket
    assert graphs.capture == CUDA and (graphs.captures > 0) == CUDA


def test_graph_steps_select_the_rows_of_a_model_ignoring_logits_to_keep(graphs_on_cpu) -> None:
    """A padded graph step keeps as many rows as it has tokens: only the probe's flag says to select them."""
    model = tiny_llama_ignoring_logits_to_keep()
    model.set_attn_implementation(FA2)
    engine = build_engine(model, GREEDY, _config(q_padding_interval_size=4, max_batch_tokens=16))
    assert engine.settings.step_options.select_logit_rows
    _run_matches_generate(engine, model)


def _changed_slots(before: list[torch.Tensor], after: list[torch.Tensor]) -> set[int]:
    changed = set()
    for old, new in zip(before, after, strict=True):
        changed |= set((old != new).flatten(1).any(1).nonzero().flatten().tolist())
    return changed


@pytest.mark.parametrize("decode", [False, True])
def test_padded_rows_write_only_the_scratch_page(graphs_on_cpu, decode: bool) -> None:
    model = tiny_llama()
    model.set_attn_implementation(FA2)
    engine = build_engine(model, GREEDY, _config(q_padding_interval_size=16))
    for i, n in enumerate([9, 4, 6]):
        engine.add(engine.build_request(Submission(list(range(5, 5 + n)), f"r{i}", max_new_tokens=4)))
    batch = engine.scheduler.schedule()
    if decode:  # prefill eagerly, then take a decode-only step
        with paged_backend(model, FA2), torch.inference_mode():
            engine.scheduler.update(batch, engine.runner.run(batch).sampled)
        batch = engine.scheduler.schedule()
    step = engine.packer.pack(batch)
    prepare_flash_step(step.metadata, engine.settings.step_options.max_blocks_per_request)
    path = DECODE if step.metadata.decode_fast_path is not None else VARLEN
    assert path == (DECODE if decode else VARLEN)
    cache = engine.cache
    before = [k.clone() for k in cache.keys]
    with paged_backend(model, FA2), torch.inference_mode():
        logits = engine.runner.graphs.run(step, path)
        eager = engine.runner.forwards(path)(
            input_ids=step.input_ids,
            position_ids=step.position_ids,
            attention_mask=engine.runner._no_mask,
            use_cache=False,
            logits_to_keep=step.logits_indices,
            cb_attention_metadata=step.metadata,
        ).logits[0]
    key = engine.runner.graphs.key_for(step, path)
    assert logits.shape[0] == key.q_len > step.input_ids.shape[1]  # the step was padded
    torch.testing.assert_close(logits[: step.logits_indices.numel()], eager.float())
    scratch = cache.scratch_page_id(0) * cache.page_size
    real = set(step.metadata.groups[0].slot_mapping.tolist())
    changed = _changed_slots(before, [k.clone() for k in cache.keys])
    assert real <= changed  # the step's own tokens were written
    assert changed - real <= set(range(scratch, scratch + cache.page_size))  # and nothing else but scratch
    assert changed - real, "the padded rows wrote their K/V somewhere: the scratch page"
    assert cache.pages_per_group[0] * cache.page_size == scratch  # outside every request's pages


# -- device options ----------------------------------------------------------------------------------


def test_cuda_options_resolve_instead_of_raising(caplog) -> None:
    config = ContinuousBatchingConfig(use_cuda_graph=True, use_async_batching=True)
    assert resolve_device_options(config, "cuda") == DeviceOptions((True, True), True)
    config = ContinuousBatchingConfig(use_async_batching=True)
    with caplog.at_level(logging.WARNING, logger="transformers_cb"):
        options = resolve_device_options(config, "cuda")
    assert options == DeviceOptions((False, False), False) and "needs use_cuda_graph=True" in caplog.text
    config = ContinuousBatchingConfig(use_cuda_graph=(False, True))
    assert resolve_device_options(config, "cuda").cuda_graphs == (False, True)
    config = ContinuousBatchingConfig(use_cuda_graph=True, use_async_batching=True)
    assert resolve_device_options(config, "cpu") == DeviceOptions((False, False), False)
    # Resolving reads the config and writes nothing back.
    assert config.use_cuda_graph is True and config.use_async_batching is True


def test_graphs_need_a_flash_backend(monkeypatch, caplog) -> None:
    monkeypatch.setattr(settings_module, "resolve_device_options", _as_configured)
    with caplog.at_level(logging.WARNING, logger="transformers_cb"):
        engine = build_engine(tiny_llama(), GREEDY, _config(auto_switch_to_flash=False))
    assert engine.runner.graphs is None and engine.settings.step_options.cuda_graphs == (False, False)
    assert "needs a paged flash-attention backend" in caplog.text


def test_buffer_turns_alternate_only_when_async() -> None:
    off = BufferTurns(torch.device("cpu"), enabled=False)
    assert [off.next_buffer() for _ in range(3)] == [0, 0, 0] and off.num_buffers == 1


# -- on CUDA: capture, replay, async ------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("async_batching", [False, True])
def test_capture_and_replay_on_cuda(graphs_on_cpu, async_batching: bool) -> None:
    model = tiny_llama().cuda()
    model.set_attn_implementation(FA2)
    config = _config(q_padding_interval_size=8, use_async_batching=async_batching)
    engine = build_engine(model, GREEDY, config)
    _run_matches_generate(engine, model)
    graphs = engine.runner.graphs
    assert graphs.captures > 0 and sum(e.replays for e in graphs.graphs.values()) > graphs.captures
    assert {key.buffer for key in graphs.graphs.ordered_keys()} == ({0, 1} if async_batching else {0})
