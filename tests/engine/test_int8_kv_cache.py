"""`ContinuousBatchingConfig(kv_cache_dtype="int8")` end to end (docs/quantization.md, "int8 KV cache").

int8 KV cannot equal `generate()` bitwise. Two references: `generate()` on a copy of the model whose attention
reads K/V rounded as the int8 pages hold them (tests/support/int8_reference.py), which the engine must equal up
to near-ties (`check_parity`, tie-aware); and plain `generate()` on the fp32 model, judged by greedy
agreement (reported, asserted loosely: most requests' first token, most tokens overall), on mixed prompts
chunked by a small token budget and preempted by a small cache, with the native kernel and without it
(the torch gathers), head sizes 16 (the kernel's portable path) and 64 (its AVX-512 int8 instance). The
cache tensors are checked really int8, every request gets one result. Page moves: swaps to the host tier
and back, fork copies and release / restore carry the scales; sizing counts int8 pages plus scales
(about 2x / 4x the pages of bf16 / fp32 in one budget); and what cannot run is refused naming the field.
"""

from __future__ import annotations

from contextlib import contextmanager
from unittest import mock

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from conformance.common import ReferenceCache, check_parity, greedy_config, run_batch, tight_num_blocks
from tests.support.int8_reference import int8_reference_model
from tests.support.models import tiny_llama, tiny_llama_without_eos
from tests.support.prompts import prompts_of_lengths
from transformers_cb import ContinuousBatchingConfig
from transformers_cb.attention.native import kernel as native
from transformers_cb.engine.engine import Engine
from transformers_cb.kv.layer_groups import FULL_ATTENTION, KVGroupSpec
from transformers_cb.kv.swap_plan import SwapPlan
from transformers_cb.memory import sizing
from transformers_cb.memory.kv_cache import PagedKVCache
from transformers_cb.memory.kv_quant import int8_cache_problem
from transformers_cb.memory.sizing import ModelShape, resolve_sizing
from transformers_cb.memory.swap import SwapCopier
from transformers_cb.runner.states.state_layers import StateLayers

MAX_NEW_TOKENS = 10
LENGTHS = [3, 41, 9, 70, 17, 2, 33, 55, 12, 26]


@contextmanager
def engines_seen():
    """The engines stepped inside the block (their cache and plan are read after the run)."""
    seen: list[Engine] = []
    original = Engine.step

    def step(self):
        if not seen or seen[-1] is not self:
            seen.append(self)
        return original(self)

    with mock.patch.object(Engine, "step", step):
        yield seen


def agreement(outputs: dict, prompts: list[list[int]], references: ReferenceCache) -> tuple[float, float]:
    """(share of requests whose first token is generate()'s, share of generate()'s tokens matched before
    the first difference), over every request."""
    first, matched, total = 0, 0, 0
    for i, prompt in enumerate(prompts):
        got, expected = outputs[f"req_{i}"].generated_tokens, references.get(prompt)
        first += got[:1] == expected[:1]
        run = next(
            (j for j, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b),
            min(len(got), len(expected)),
        )
        matched += run
        total += len(expected)
    return first / len(prompts), matched / total


@pytest.mark.parametrize("switch", ["1", "0"], ids=["native", "torch"])
@pytest.mark.parametrize("head_dim", [16, 64])
def test_int8_cache_runs_chunked_and_preempted_close_to_generate(
    head_dim: int, switch: str, monkeypatch
) -> None:
    monkeypatch.setenv(native.ENV_SWITCH, switch)
    if switch == "1" and native.ensure_native_module() is None:
        pytest.skip("the native CPU kernel cannot be built here")
    model = tiny_llama_without_eos(hidden_size=4 * head_dim, seed=1)
    prompts = prompts_of_lengths(LENGTHS, seed=5)
    references = ReferenceCache(model, MAX_NEW_TOKENS)
    page_size = 4
    with engines_seen() as engines:
        outputs, preempted = run_batch(
            model,
            prompts,
            greedy_config(MAX_NEW_TOKENS),
            page_size=page_size,
            max_batch_tokens=16,  # prompts chunked
            num_blocks=tight_num_blocks(prompts, MAX_NEW_TOKENS, page_size),  # requests preempted
            kv_cache_dtype="int8",
        )
    assert len(outputs) == len(prompts) and preempted, "every request one result, some preempted"
    assert all(len(outputs[f"req_{i}"].generated_tokens) == MAX_NEW_TOKENS for i in range(len(prompts)))
    cache = engines[-1].cache
    assert [t.dtype for t in cache.group_tensors] == [torch.int8]
    assert cache.quantized and cache.scale_tensors[0].dtype == torch.float32
    assert float(cache.scale_tensors[0].abs().sum()) > 0  # the scales were written
    first, tokens = agreement(outputs, prompts, references)
    print(f"int8 KV, head_dim {head_dim}, native={switch}: first tokens {first:.0%}, tokens {tokens:.0%}")
    assert first >= 0.8 and tokens >= 0.6, (first, tokens)
    # The precise reference: generate() attending the K/V the int8 pages hold, equal up to near-ties.
    rounded = int8_reference_model(model)
    expected = ReferenceCache(rounded, MAX_NEW_TOKENS)
    check_parity(
        rounded, prompts, outputs, [expected.get(p) for p in prompts], f"int8 KV, head_dim {head_dim}"
    )


def test_native_and_torch_paths_agree_on_int8_pages(monkeypatch) -> None:
    """Both read the same dequantized K/V (float tolerance apart): the same greedy tokens, near-ties aside."""
    if native.ensure_native_module() is None:
        pytest.skip("the native CPU kernel cannot be built here")
    model = tiny_llama_without_eos(hidden_size=256, seed=2)
    prompts = prompts_of_lengths(LENGTHS, seed=6)
    runs = []
    for switch in ("1", "0"):
        monkeypatch.setenv(native.ENV_SWITCH, switch)
        outputs, _ = run_batch(model, prompts, greedy_config(8), page_size=8, kv_cache_dtype="int8")
        runs.append([outputs[f"req_{i}"].generated_tokens for i in range(len(prompts))])
    same = sum(a == b for a, b in zip(*runs, strict=True))
    assert same >= len(prompts) - 1, runs


def test_swaps_to_the_host_tier_carry_the_scales() -> None:
    """Pages swapped out and back in (to other page ids) come back with their scales, bit for bit."""
    cache = PagedKVCache(2, 6, 4, 2, 16, torch.int8, torch.device("cpu"))
    slots = torch.arange(24)
    for layer in range(2):
        cache.write(layer, slots, torch.randn(24, 2, 16) * (layer + 1), torch.randn(24, 2, 16))
    host_pages = torch.empty(2, 2, 4, 4, 2, 16, dtype=torch.int8)
    host_scales = torch.empty(2, 2, 4, 4, 2)
    copier = SwapCopier(cache.group_tensors, [host_pages], cache.scale_tensors, [host_scales])
    pages, scales = cache.group_tensors[0].clone(), cache.scale_tensors[0].clone()
    copier.run(SwapPlan(1, out_src=[[1, 4]], out_dst=[[0, 3]]))
    cache.group_tensors[0].zero_()
    cache.scale_tensors[0].zero_()
    copier.run(SwapPlan(1, in_src=[[0, 3]], in_dst=[[2, 5]]))
    assert torch.equal(cache.group_tensors[0][:, :, [2, 5]], pages[:, :, [1, 4]])
    assert torch.equal(cache.scale_tensors[0][:, :, [2, 5]], scales[:, :, [1, 4]])
    assert copier.num_copies == 2  # the scales ride with the pages' copies


def test_fork_copies_and_release_carry_the_scales() -> None:
    cache = PagedKVCache(2, 4, 4, 2, 16, torch.int8, torch.device("cpu"))
    cache.write(1, torch.arange(4), torch.randn(4, 2, 16), torch.randn(4, 2, 16))
    cache.copy_pages([(0, 0, 3)])  # a fork's copy of page 0 into page 3
    assert torch.equal(cache.keys[1][12:16], cache.keys[1][0:4])
    assert torch.equal(cache.key_scales[1][12:16], cache.key_scales[1][0:4])
    assert torch.equal(cache.value_scales[1][12:16], cache.value_scales[1][0:4])
    total = cache.nbytes()
    assert total == cache.layout.nbytes() == 2 * 2 * 4 * 4 * 2 * (16 + 4)
    assert cache.release() == total and cache.layer_scales(1)[0].numel() == 0  # type: ignore[index]
    cache.restore()
    assert cache.scale_tensors[0].shape == (2, 2, 4, 4, 2) and float(cache.scale_tensors[0].abs().sum()) == 0
    assert cache.key_scales[1].shape == (16, 2)


@pytest.mark.parametrize("dtype, ratio", [(torch.bfloat16, (1.8, 2.0)), (torch.float32, (3.6, 4.0))])
def test_the_same_memory_holds_about_2x_bf16_and_4x_fp32_pages(dtype, ratio, monkeypatch) -> None:
    monkeypatch.setattr(sizing, "free_memory_bytes", lambda device: 2**30)
    shape = ModelShape(4, 2, 64, 256, 512, 300, 4096)
    pages = {}
    for kv in ("auto", "int8"):
        config = ContinuousBatchingConfig(kv_cache_dtype=kv, max_memory_percent=0.1, page_size=16)
        pages[kv] = resolve_sizing(config, shape, torch.device("cpu"), dtype).num_pages
    assert ratio[0] <= pages["int8"] / pages["auto"] <= ratio[1], pages
    # what the layout (and `stats().kv_bytes_per_token`) counts: int8 values plus a scale per head and stream
    cache = PagedKVCache(4, 2, 16, 2, 64, torch.int8, torch.device("cpu"))
    assert cache.layout.bytes_per_token() == shape.kv_bytes_per_token(1, 4) == 4 * 2 * 2 * (64 + 4)


def test_stats_report_the_int8_bytes_per_token() -> None:
    model = tiny_llama()
    with engines_seen() as engines:
        run_batch(model, prompts_of_lengths([5, 9]), greedy_config(3), page_size=4, kv_cache_dtype="int8")
    snapshot = engines[-1].snapshot()
    heads, dim, layers = 2, 16, 2
    assert snapshot.kv_bytes_per_token == layers * 2 * heads * (dim + 4)


def test_bad_value_and_unsupported_models_are_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        ContinuousBatchingConfig(kv_cache_dtype="fp8")
    config = AutoConfig.for_model(
        "deepseek_v3",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        q_lora_rank=None,
        n_routed_experts=2,
        num_experts_per_tok=1,
        first_k_dense_replace=1,
    )
    latent_model = AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(ValueError, match="kv_cache_dtype='int8' does not support a multi-latent"):
        run_batch(latent_model, [[1, 2, 3]], greedy_config(2), kv_cache_dtype="int8")
    plain = KVGroupSpec(FULL_ATTENTION, (0,))
    assert int8_cache_problem([plain], "paged|sdpa") is None
    assert "flash" in (int8_cache_problem([plain], "paged|flash_attention_2") or "")
    assert "V head size" in (int8_cache_problem([KVGroupSpec(FULL_ATTENTION, (0,), value_dim=8)], None) or "")


def test_offloaded_requests_swap_their_scales_and_stay_on_the_reference() -> None:
    """CPU offload on an int8 cache: preempted requests' pages and scales go to the host tier and back
    (no recompute), and the outputs still equal the int8-rounded generate() up to near-ties."""
    model = tiny_llama_without_eos(hidden_size=256, seed=3)
    prompts = prompts_of_lengths(LENGTHS, seed=8)
    with engines_seen() as engines:
        outputs, preempted = run_batch(
            model,
            prompts,
            greedy_config(MAX_NEW_TOKENS),
            page_size=4,
            max_batch_tokens=16,
            num_blocks=tight_num_blocks(prompts, MAX_NEW_TOKENS, 4),
            cpu_offload_space=0.05,
            kv_cache_dtype="int8",
        )
    engine = engines[-1]
    swapper = engine.runner.swapper
    assert preempted and swapper is not None and swapper.pages_in > 0, "nothing swapped back in"
    assert [t.dtype for t in swapper.host_tensors] == [torch.int8] and swapper.host_scales
    rounded = int8_reference_model(model)
    expected = ReferenceCache(rounded, MAX_NEW_TOKENS)
    check_parity(rounded, prompts, outputs, [expected.get(p) for p in prompts], "int8 KV, offloaded")


def test_release_and_resume_rebuild_the_int8_pages_and_scales() -> None:
    """`release_cache()` frees the int8 pages, their scales and the host tier's; after `resume_cache()`
    the same requests give the same tokens."""
    from tests.support.manager import collect
    from tests.support.threads import TIMEOUT

    model = tiny_llama_without_eos(hidden_size=256, seed=4)
    prompts = prompts_of_lengths([9, 14, 5], seed=7)
    config = ContinuousBatchingConfig(page_size=16, kv_cache_dtype="int8", cpu_offload_space=0.01)
    manager = model.init_continuous_batching(continuous_batching_config=config)
    try:
        manager.start()
        engine = manager.engine
        cache_bytes = engine.cache.nbytes()
        ids = manager.add_requests(prompts, max_new_tokens=MAX_NEW_TOKENS)
        outputs = collect(manager, ids)
        first = [outputs[i].generated_tokens for i in ids]
        manager.release_cache()
        assert engine.cache.nbytes() == 0 and all(t.numel() == 0 for t in engine.cache.scale_tensors)
        swapper = engine.runner.swapper
        assert swapper is not None and all(t.numel() == 0 for t in swapper.host_scales)
        manager.resume_cache()
        assert engine.cache.nbytes() == cache_bytes and engine.cache.scale_tensors[0].dtype == torch.float32
        assert swapper.host_scales[0].numel() > 0
        ids = manager.add_requests(prompts, max_new_tokens=MAX_NEW_TOKENS)
        outputs = collect(manager, ids)
        assert [outputs[i].generated_tokens for i in ids] == first
    finally:
        manager.stop(hard_stop=True, timeout=TIMEOUT)


def test_a_model_with_state_layers_keeps_its_states_in_float() -> None:
    """Bamba (Mamba-2 layers beside attention): the attention layers' pages are int8, the state slots keep
    the model's dtype, and the outputs equal the int8-rounded generate() up to near-ties."""
    from tests.support.hybrids import build_hybrid

    model = build_hybrid("bamba")
    model.generation_config.eos_token_id = None
    prompts = prompts_of_lengths([5, 30, 12], vocab=model.config.vocab_size, seed=1)
    with engines_seen() as engines:
        outputs, _ = run_batch(
            model, prompts, greedy_config(6), page_size=4, max_batch_tokens=16, kv_cache_dtype="int8"
        )
    engine = engines[-1]
    assert [t.dtype for t in engine.cache.group_tensors] == [torch.int8]
    states = engine.runner.states
    assert isinstance(states, StateLayers) and {t.dtype for t in states.cache.tensors.values()} == {
        torch.float32
    }
    rounded = int8_reference_model(model)
    expected = ReferenceCache(rounded, 6)
    check_parity(rounded, prompts, outputs, [expected.get(p) for p in prompts], "bamba, int8 KV")


def test_forks_and_prefix_hits_share_and_copy_the_scales() -> None:
    """Prompts of one shared prefix with `num_return_sequences=2` under pressure: later requests hit the
    prefix cache (pages and scales another request wrote), forks copy their partial page with its scales;
    every fork equals its parent's reference, the int8-rounded generate() up to near-ties."""
    model = tiny_llama_without_eos(hidden_size=256, seed=5)
    prefix = prompts_of_lengths([13], seed=9)[0]
    prompts = [prefix + suffix for suffix in prompts_of_lengths([3, 6, 1, 9], seed=10)]
    copies: list = []
    original = PagedKVCache.copy_pages

    def copy_pages(self, pairs):
        copies.extend(pairs)
        return original(self, pairs)

    config = ContinuousBatchingConfig(
        page_size=4,
        max_batch_tokens=16,
        num_blocks=tight_num_blocks(prompts, MAX_NEW_TOKENS, 4) + 4,
        cpu_offload_space=None,
        kv_cache_dtype="int8",
    )
    with engines_seen() as engines, mock.patch.object(PagedKVCache, "copy_pages", copy_pages):
        outputs = model.generate_batch(
            prompts,
            greedy_config(MAX_NEW_TOKENS),
            continuous_batching_config=config,
            num_return_sequences=2,
            progress_bar=False,
        )
    assert copies, "no fork copied a page"
    assert engines[-1].scheduler.pages.prefix.stats.hit_tokens > 0, "no prefix cache hit"
    rounded = int8_reference_model(model)
    expected = ReferenceCache(rounded, MAX_NEW_TOKENS)
    parents = {f"req_{i}": outputs[f"req_{i}"] for i in range(len(prompts))}
    check_parity(rounded, prompts, parents, [expected.get(p) for p in prompts], "int8 KV, forks")
    for i in range(len(prompts)):
        assert outputs[f"req_{i}__child#0"].generated_tokens == outputs[f"req_{i}"].generated_tokens
