"""Sliding-window and hybrid models: layer groups, the sliding page policy, bounded pages, stats, refusals."""

from __future__ import annotations

import logging
import math
from unittest import mock

import pytest
import torch
from transformers import (
    AutoConfig,
    GenerationConfig,
    T5Config,
    T5ForConditionalGeneration,
)

from conformance.common import check_parity
from tests.support.hybrids import build_hybrid
from tests.support.models import SLIDING_WINDOW, build_tiny_model, vocab_size
from tests.support.prompts import prompts_of_lengths
from tests.support.reference import greedy_reference
from tests.support.requests import make_request
from tests.support.threads import TIMEOUT
from transformers_cb import ContinuousBatchingConfig
from transformers_cb.attention import paged as paged_module
from transformers_cb.attention.backends import sdpa as sdpa_module
from transformers_cb.attention.backends.eager import eager_attend
from transformers_cb.attention.native import kernel as native
from transformers_cb.attention.native.kernel import native_paged_attention
from transformers_cb.engine.build import build_engine
from transformers_cb.engine.engine import Engine
from transformers_cb.invariants import InvariantError
from transformers_cb.kv.layer_groups import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    KVGroupSpec,
    kv_groups_from_config,
)
from transformers_cb.kv.page_manager import PageManager
from transformers_cb.kv.page_policies import FullAttentionPolicy, SlidingWindowPolicy
from transformers_cb.kv.pool import PagePool
from transformers_cb.memory.block_tables import BlockTables
from transformers_cb.memory.kv_cache import PagedKVCache
from transformers_cb.model_check.model_support import check_model_supported
from transformers_cb.requests import PageList


# -- layer groups from configs ---------------------------------------------------------------------
def test_layer_groups_follow_each_models_convention() -> None:
    groups = {name: kv_groups_from_config(build_tiny_model(name).config) for name in ("llama", "mistral")}
    assert groups["llama"] == [KVGroupSpec(FULL_ATTENTION, (0, 1))]
    # Mistral has no layer_types: `sliding_window` makes every layer sliding.
    assert groups["mistral"] == [KVGroupSpec(SLIDING_ATTENTION, (0, 1), SLIDING_WINDOW)]
    # Qwen2: use_sliding_window with max_window_layers=1 -> layer 0 full, layer 1 sliding; off -> all full.
    qwen2 = build_tiny_model("qwen2_sliding").config
    assert kv_groups_from_config(qwen2) == [
        KVGroupSpec(FULL_ATTENTION, (0,)),
        KVGroupSpec(SLIDING_ATTENTION, (1,), SLIDING_WINDOW),
    ]
    assert kv_groups_from_config(build_tiny_model("qwen2").config) == [KVGroupSpec(FULL_ATTENTION, (0, 1))]
    gemma3 = kv_groups_from_config(build_tiny_model("gemma3").config)
    assert gemma3 == [KVGroupSpec(FULL_ATTENTION, (5,)), KVGroupSpec(SLIDING_ATTENTION, (0, 1, 2, 3, 4), 8)]
    mistral_full = AutoConfig.for_model("mistral", sliding_window=None, num_hidden_layers=3)
    assert kv_groups_from_config(mistral_full) == [KVGroupSpec(FULL_ATTENTION, (0, 1, 2))]


# -- the sliding policy ---------------------------------------------------------------------------
def test_sliding_policy_drops_pages_outside_the_window() -> None:
    pool = PagePool(10)
    policy = SlidingWindowPolicy(pool, page_size=4, sliding_window=6)
    request = make_request(num_prompt_tokens=100, max_new_tokens=1)
    # A query at q reads keys (q - 6, q]: positions 0..5 need page 0, 6 reads 1..6 -> still page 0.
    assert [policy.first_needed_page(q) for q in (0, 5, 6, 8, 9, 12, 13)] == [0, 0, 0, 0, 1, 1, 2]
    assert policy.window_pages() == 3 == math.ceil(6 / 4) + 1
    assert [policy.max_pages(n) for n in (1, 4, 5, 9, 100)] == [1, 1, 2, 3, 3]
    assert policy.allocate(request, 10)  # a 10-token chunk: pages 0, 1, 2
    assert request.pages[0] == PageList([0, 1, 2], 0)
    request.num_computed_tokens = 10
    assert policy.trim(request) == 1  # the next query (10) reads keys 5..10: page 0 is out
    assert request.pages[0] == PageList([1, 2], 1)
    assert pool.num_free_pages == 8
    assert policy.num_new_pages(request, 2) == 0 and policy.num_new_pages(request, 3) == 1
    assert policy.num_fitting_tokens(request, 100) == (3 + 8) * 4 - 10  # held end + free pages
    for _ in range(30):  # decode: never more than window_pages() pages
        assert policy.allocate(request, 1)
        assert len(request.pages[0].page_ids) <= policy.window_pages()
        request.num_computed_tokens += 1
        policy.trim(request)
        policy.check_request(request)
        pool.check_integrity([request.pages[0].page_ids])
    policy.free(request)
    assert request.pages[0] == PageList([], 0) and pool.num_free_pages == 10


def test_window_of_one_token_can_drop_every_page() -> None:
    pool = PagePool(4)
    policy = SlidingWindowPolicy(pool, page_size=4, sliding_window=1)
    request = make_request(num_prompt_tokens=100, max_new_tokens=1)
    assert policy.allocate(request, 8)
    request.num_computed_tokens = 8
    assert policy.trim(request) == 2
    assert request.pages[0] == PageList([], 2)
    assert policy.num_new_pages(request, 1) == 1
    assert policy.allocate(request, 1) and request.pages[0].end_page == 3
    policy.check_request(request)


def test_trim_and_check_take_an_explicit_bound() -> None:
    """A caller whose window starts before the request's computed tokens (a draft model's shadow, whose
    draft tokens past its last verified one may be rolled back) passes that bound; the request is not
    written."""
    pool = PagePool(10)
    policy = SlidingWindowPolicy(pool, page_size=4, sliding_window=6)
    request = make_request(num_prompt_tokens=100, max_new_tokens=1)
    assert policy.allocate(request, 16)
    request.num_computed_tokens = 16
    assert policy.trim(request, 9) == 1  # a query at 9 reads keys 4..9: only page 0 is out
    assert request.num_computed_tokens == 16 and request.pages[0] == PageList([1, 2, 3], 1)
    policy.check_request(request, 9)
    with pytest.raises(InvariantError, match="before its window"):
        policy.check_request(request)  # from 16 on, page 1 is before the window
    assert policy.trim(request) == 1


def test_page_manager_is_check_then_commit_across_groups() -> None:
    full_pool, sliding_pool = PagePool(3), PagePool(8)
    page_manager = PageManager(
        [FullAttentionPolicy(full_pool, 4, 0), SlidingWindowPolicy(sliding_pool, 4, 4, 1)],
        [KVGroupSpec(FULL_ATTENTION, (0,)), KVGroupSpec(SLIDING_ATTENTION, (1,), 4)],
    )
    a, b = make_request("a", 100, 1), make_request("b", 100, 1)
    assert page_manager.allocate(a, 8)
    assert [p.page_ids for p in a.pages] == [[0, 1], [0, 1]]
    # b needs 2 full pages, only 1 is free: neither group changes.
    assert page_manager.num_fitting_tokens(b, 8) == 4
    assert not page_manager.allocate(b, 8)
    assert full_pool.num_free_pages == 1 and sliding_pool.num_free_pages == 6
    assert all(not p.page_ids for p in b.pages)
    assert page_manager.free_fraction == pytest.approx(1 / 3)
    assert page_manager.unfittable_reason(13) == (
        "needs 4 KV pages of 4 tokens in layer group full_attention but the cache has only 3"
    )
    a.num_computed_tokens = 8
    assert page_manager.trim(a) == 1  # the sliding group drops page 0, the full group keeps everything
    assert page_manager.pages_in_use() == {"full_attention": 2, "sliding_attention(window=4)": 1}
    page_manager.check_integrity([a, b], [a])
    page_manager.free(a)
    assert page_manager.pages_in_use() == {"full_attention": 0, "sliding_attention(window=4)": 0}


def test_block_table_ring_keeps_logical_pages_in_place() -> None:
    tables = BlockTables(max_pages_per_request=3, device=torch.device("cpu"), initial_rows=1)
    request = make_request(num_prompt_tokens=100, max_new_tokens=1)
    request.pages = [PageList([7, 8], 0)]
    row = tables.sync(request)
    request.pages[0] = PageList([8, 5, 6], 1)  # page 0 dropped, logical pages 2 and 3 added
    tables.sync(request)
    assert tables.table[row].tolist() == [6, 8, 5]  # logical page p sits in column p % 3
    request.pages[0] = PageList([4], 9)  # everything before logical page 9 dropped at once
    tables.sync(request)
    assert tables.table[row, 9 % 3].item() == 4


# -- engine: bounded pages on long decodes, stats --------------------------------------------------
def _pages_per_step(model, prompts, max_new_tokens, **cb_kwargs):
    """Run generate_batch; after every step record (per group: pages in use, max pages of one request)."""
    records = []
    original = Engine.step

    def step(self):
        result = original(self)
        self.check_integrity()
        policies = self.scheduler.pages.policies
        per_request = [
            max((len(a.pages(r).page_ids) for r in self.scheduler.running), default=0) for a in policies
        ]
        records.append((self.scheduler.pages.pages_in_use(), per_request))
        return result

    config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    with mock.patch.object(Engine, "step", step):
        outputs = model.generate_batch(
            prompts,
            generation_config=config,
            continuous_batching_config=ContinuousBatchingConfig(**cb_kwargs),
            progress_bar=False,
        )
    return outputs, records


def test_long_decode_on_a_sliding_model_holds_a_bounded_number_of_pages() -> None:
    model = build_tiny_model("mistral")
    page_size, max_new = 4, 120
    prompts = prompts_of_lengths([30, 30], vocab_size(model), seed=3)
    outputs, records = _pages_per_step(model, prompts, max_new, page_size=page_size, max_batch_tokens=16)
    bound = math.ceil(SLIDING_WINDOW / page_size) + 1
    decode_records = records[4:]  # after the prompts' chunks (16 tokens a step)
    assert max(per_request[0] for _, per_request in decode_records) <= bound
    # Flat once the windows are full (each request between bound - 1 and bound pages) until the
    # requests finish, where a full-attention cache would have grown to ceil(150 / 4) = 38 pages each.
    steady = [in_use["sliding_attention(window=8)"] for in_use, _ in decode_records][:-3]
    assert len(steady) > 100 and max(steady) <= 2 * bound and max(steady) - min(steady) <= 2, steady
    references = [greedy_reference(model, p, max_new) for p in prompts]
    check_parity(model, prompts, outputs, references, "mistral long decode")


def test_hybrid_model_grows_its_full_group_only() -> None:
    model = build_tiny_model("gemma3")
    prompt = prompts_of_lengths([12], vocab_size(model), seed=4)
    outputs, records = _pages_per_step(model, prompt, 60, page_size=4)
    full = [in_use["full_attention"] for in_use, _ in records]
    sliding = [in_use["sliding_attention(window=8)"] for in_use, _ in records]
    assert full[-2] == math.ceil((12 + 59) / 4)  # every token's KV, before the last step frees it
    assert max(sliding[1:]) <= math.ceil(8 / 4) + 1
    check_parity(model, prompt, outputs, [greedy_reference(model, prompt[0], 60)], "gemma3 long decode")


def test_manager_stats_report_pages_per_group() -> None:
    model = build_tiny_model("qwen2_sliding")
    prompt = prompts_of_lengths([20], vocab_size(model), seed=5)[0]
    config = GenerationConfig(max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0)
    manager = model.init_continuous_batching(
        generation_config=config,
        continuous_batching_config=ContinuousBatchingConfig(page_size=4, num_blocks=32),
    )
    manager.start()
    try:
        assert manager.stats().pages_in_use_by_group == {
            "full_attention": 0,
            "sliding_attention(window=8)": 0,
        }
        assert manager.stats().pages_total == 64  # 32 pages in each group
        manager.add_request(prompt, request_id="a")
        result = manager.get_result(request_id="a", timeout=TIMEOUT)
        assert result is not None and result.is_finished()
        stats = manager.stats()
        assert stats.pages_in_use_by_group == {"full_attention": 0, "sliding_attention(window=8)": 0}
        assert stats.pages_in_use == 0
    finally:
        manager.stop(block=True)


def test_max_blocks_per_request_is_forced_to_zero_on_sliding_models(caplog) -> None:
    model = build_tiny_model("mistral")
    with caplog.at_level(logging.WARNING, logger="transformers_cb.engine.engine"):
        engine = build_engine(model, None, ContinuousBatchingConfig(max_blocks_per_request=32, num_blocks=8))
    assert engine.settings.step_options.max_blocks_per_request == 0
    assert (
        engine.settings.config.max_blocks_per_request == 32
    )  # the setting as given: resolving writes no config
    assert "max_blocks_per_request=32 forced to 0" in caplog.text


def test_sliding_group_is_sized_to_its_windows() -> None:
    model = build_tiny_model("qwen2_sliding")
    engine = build_engine(
        model, None, ContinuousBatchingConfig(page_size=4, max_batch_tokens=16), workload=[200] * 4
    )
    full, sliding = engine.cache.pages_per_group
    assert full >= 4 * 50
    # Each request holds its window + one chunk at most: ceil((8 - 1 + 16) / 4) + 1 = 7 pages.
    assert sliding < full and 4 * 7 <= sliding <= math.ceil(4 * 7 / (1 - 0.15))
    assert engine.cache.keys[1].shape[0] == sliding * 4  # layer 1 is the sliding layer


# -- refusals ---------------------------------------------------------------------------------------
REFUSED_CONFIGS = {
    "encoder-decoder": (
        lambda: T5Config(num_layers=1, d_model=16, d_kv=4, num_heads=2, d_ff=32),
        "encoder-decoder",
    ),
    "gemma3_bidirectional": (
        lambda: AutoConfig.for_model("gemma3_text", use_bidirectional_attention=True),
        "bidirectional",
    ),
    # DeepSeek V4: compressed entries from a compressor with per-request state, picked by a Lightning Indexer.
    "deepseek_v4": (
        lambda: AutoConfig.for_model("deepseek_v4"),
        "DeepSeek V4's compressed attention .* no page group of compressed entries, no per-request compressor "
        "state, and no top-k over compressed entries",
    ),
    # DeepSeek sparse attention with no indexer key size: its keys cannot be stored beside the latent.
    "deepseek_v32": (
        lambda: AutoConfig.for_model("deepseek_v32", num_hidden_layers=1, index_head_dim=0),
        "DeepSeek sparse attention \\(indexed_attention layers\\) with index_head_dim=0",
    ),
}


@pytest.mark.parametrize("name", sorted(REFUSED_CONFIGS))
def test_unsupported_models_are_refused_naming_type_and_reason(name: str) -> None:
    make_config, reason = REFUSED_CONFIGS[name]
    config = make_config()
    with pytest.raises(NotImplementedError, match=reason) as info:
        check_model_supported(config)
    assert repr(config.get_text_config().model_type) in str(info.value)


def test_unknown_layer_type_is_refused() -> None:
    config = build_tiny_model("qwen2_sliding").config
    config.layer_types = ["full_attention", "reference_sliding_attention"]
    with pytest.raises(
        NotImplementedError,
        match=r"model_type='qwen2' has layers of attention type \['reference_sliding_attention'\]",
    ):
        check_model_supported(config)


@pytest.mark.parametrize("build", ["t5", "zamba2"])
def test_refused_before_anything_is_allocated(build: str) -> None:
    torch.manual_seed(0)
    if build == "t5":
        model = T5ForConditionalGeneration(
            T5Config(num_layers=1, d_model=16, d_kv=4, num_heads=2, d_ff=32, vocab_size=64)
        )
    else:  # refused by what its forward does (a shared attention block), after its state probe
        model = build_hybrid("zamba2")
    with (
        mock.patch.object(PagedKVCache, "__init__", side_effect=AssertionError("allocated")) as cache_init,
        pytest.raises(NotImplementedError, match=f"model_type='{model.config.model_type}'"),
    ):
        model.generate_batch(
            [[3, 4, 5]], generation_config=GenerationConfig(max_new_tokens=2), progress_bar=False
        )
    cache_init.assert_not_called()


@pytest.mark.parametrize("native_kernel", ["0", "1"])
def test_softcap_layers_under_paged_sdpa_match_eager_generate(native_kernel: str, monkeypatch) -> None:
    """SDPA has no softcap argument: under `paged|sdpa` a softcapped layer takes the eager kernel, in
    continuous batching and in plain `generate()` on the paged model; with the native CPU kernel on,
    that kernel applies the softcap itself (these short steps never reach SDPA). transformers 5.23
    refuses sdpa for every model that passes a softcap (Gemma 2 here), so the test lifts that refusal."""
    monkeypatch.setenv(native.ENV_SWITCH, native_kernel)
    native_on = native_kernel == "1" and native.ensure_native_module() is not None
    model = build_tiny_model("gemma2", attn_implementation="eager", attn_logit_softcapping=0.5)
    prompts = prompts_of_lengths([3, 11, 26], vocab_size(model), seed=6)
    references = [greedy_reference(model, p, 12) for p in prompts]
    config = GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    softcaps = []

    def spy(*args):
        softcaps.append(args[6])  # the softcap argument of the eager kernel
        return eager_attend(*args)

    def native_spy(*args):
        softcaps.append(args[9])  # the softcap argument of the native kernel
        return native_paged_attention(*args)

    with (
        mock.patch.object(type(model), "_supports_sdpa", True),
        mock.patch.object(sdpa_module, "eager_attend", spy),
        mock.patch.object(paged_module, "native_paged_attention", native_spy),
    ):
        model.set_attn_implementation("paged|sdpa")
        outputs = model.generate_batch(
            prompts,
            generation_config=config,
            continuous_batching_config=ContinuousBatchingConfig(page_size=4, max_batch_tokens=8),
            progress_bar=False,
        )
        kernel = "native" if native_on else "eager"
        assert softcaps and set(softcaps) == {0.5}, f"softcapped layers did not take the {kernel} kernel"
        check_parity(model, prompts, outputs, references, "gemma2 softcap under paged|sdpa")
        assert [greedy_reference(model, p, 12) for p in prompts] == references  # plain generate() fallback
