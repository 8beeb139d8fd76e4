"""Chunked attention (Llama 4's `attention_chunk_size`) as a KV group kind: its layer groups, its page policy
(a request keeps only its current chunk's pages, as a sliding group keeps its window), its sizing, and
the engine holding a bounded number of pages on a long decode."""

from __future__ import annotations

import math
from unittest import mock

import pytest
from transformers import AutoConfig, GenerationConfig

from conformance.common import check_parity
from tests.support.models import CHUNK_SIZE, build_tiny_model, vocab_size
from tests.support.prompts import prompts_of_lengths
from tests.support.reference import greedy_reference
from tests.support.requests import make_request
from transformers_cb import ContinuousBatchingConfig
from transformers_cb.engine.build import build_engine
from transformers_cb.engine.engine import Engine
from transformers_cb.invariants import InvariantError
from transformers_cb.kv.layer_groups import (
    CHUNKED_ATTENTION,
    FULL_ATTENTION,
    KVGroupSpec,
    kv_groups_from_config,
)
from transformers_cb.kv.page_policies import ChunkedAttentionPolicy, make_page_policy
from transformers_cb.kv.pool import PagePool
from transformers_cb.memory.sizing import max_pages_held
from transformers_cb.model_check.model_support import check_model_supported
from transformers_cb.requests import PageList


def test_llama4_layers_form_a_full_and_a_chunked_group() -> None:
    config = build_tiny_model("llama4").config
    groups = kv_groups_from_config(config)
    # no_rope_layers: every fourth layer is NoPE and full attention, the others chunked.
    assert groups == [
        KVGroupSpec(FULL_ATTENTION, (3,)),
        KVGroupSpec(CHUNKED_ATTENTION, (0, 1, 2), attention_chunk_size=CHUNK_SIZE),
    ]
    assert groups[1].name == f"chunked_attention(chunk={CHUNK_SIZE})" and groups[1].span == CHUNK_SIZE
    assert groups[0].span is None
    assert isinstance(make_page_policy(groups[1], PagePool(4), 4, 1), ChunkedAttentionPolicy)
    check_model_supported(config)  # no longer refused


def test_chunked_layers_need_a_chunk_size() -> None:
    config = AutoConfig.for_model("llama4_text", num_hidden_layers=2, attention_chunk_size=8)
    config.attention_chunk_size = None
    with pytest.raises(ValueError, match="chunked_attention layers but attention_chunk_size=None"):
        kv_groups_from_config(config)


def test_chunked_policy_keeps_only_the_current_chunk() -> None:
    pool = PagePool(10)
    policy = ChunkedAttentionPolicy(pool, page_size=4, chunk_size=6)
    request = make_request(num_prompt_tokens=100, max_new_tokens=1)
    # A query at q reads keys [q // 6 * 6, q]: chunk starts 0, 6, 12, 18 -> pages 0, 1, 3, 4.
    assert [policy.first_needed_page(q) for q in (0, 5, 6, 11, 12, 17, 18)] == [0, 0, 1, 1, 3, 3, 4]
    assert policy.chunk_pages() == 3 == math.ceil(5 / 4) + 1
    assert [policy.max_pages(n) for n in (1, 4, 5, 9, 100)] == [1, 1, 2, 3, 3]
    assert policy.allocate(request, 13)  # pages 0..3
    request.num_computed_tokens = 13
    assert policy.trim(request) == 3  # the next query (13) reads keys 12..13: pages 0..2 are out
    assert request.pages[0] == PageList(request.pages[0].page_ids, 3) and len(request.pages[0].page_ids) == 1
    policy.check_request(request)
    held = []
    for _ in range(40):  # decode: never more than chunk_pages() pages
        assert policy.allocate(request, 1)
        held.append(len(request.pages[0].page_ids))
        request.num_computed_tokens += 1
        policy.trim(request)
        policy.check_request(request)
        pool.check_integrity([request.pages[0].page_ids])
    assert max(held) <= policy.chunk_pages() and min(held) == 1  # a new chunk starts on a fresh page
    policy.free(request)
    assert request.pages[0] == PageList([], 0) and pool.num_free_pages == 10


def test_check_request_refuses_pages_held_before_the_chunk() -> None:
    pool = PagePool(10)
    policy = ChunkedAttentionPolicy(pool, page_size=4, chunk_size=8)
    request = make_request(num_prompt_tokens=100, max_new_tokens=1)
    assert policy.allocate(request, 17)
    request.num_computed_tokens = 17
    assert policy.trim(request, 9) == 2  # a rollback bound inside chunk 1 (keys 8..) still reads page 2
    assert request.num_computed_tokens == 17 and request.pages[0].first_page == 2
    policy.check_request(request, 9)
    with pytest.raises(InvariantError, match="before its window or chunk"):
        policy.check_request(request)  # from 17 on (chunk 2: keys 16..), pages 2..3 are out
    assert policy.trim(request) == 2


def test_a_chunked_group_is_sized_to_its_chunks() -> None:
    spec = KVGroupSpec(CHUNKED_ATTENTION, (0,), attention_chunk_size=8)
    # A request holds its chunk plus the prefill chunk a step writes, however long it is.
    assert max_pages_held(spec, 1000, 4, 16) == math.ceil((8 - 1 + 16) / 4) + 1
    assert max_pages_held(spec, 10, 4, 16) == 3
    engine = build_engine(
        build_tiny_model("llama4"),
        None,
        ContinuousBatchingConfig(page_size=4, max_batch_tokens=16),
        workload=[200] * 4,
    )
    full, chunked = engine.cache.pages_per_group
    assert full >= 4 * 50 and chunked < full
    assert engine.settings.step_options.max_blocks_per_request == 0  # recycled pages: no decode fast path


def test_long_decode_holds_a_bounded_number_of_chunk_pages() -> None:
    model = build_tiny_model("llama4")
    page_size, max_new = 4, 60
    prompts = prompts_of_lengths([30, 21], vocab_size(model), seed=3)
    records = []
    original = Engine.step

    def step(self):
        result = original(self)
        self.check_integrity()
        chunked = self.scheduler.pages.policies[1]
        records.append(max((len(chunked.pages(r).page_ids) for r in self.scheduler.running), default=0))
        return result

    config = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0)
    with mock.patch.object(Engine, "step", step):
        outputs = model.generate_batch(
            prompts,
            generation_config=config,
            continuous_batching_config=ContinuousBatchingConfig(page_size=page_size, max_batch_tokens=16),
            progress_bar=False,
        )
    decode_records = records[4:]  # after the prompts' chunks
    assert decode_records and max(decode_records) <= math.ceil((CHUNK_SIZE - 1) / page_size) + 1
    references = [greedy_reference(model, p, max_new) for p in prompts]
    check_parity(model, prompts, outputs, references, "llama4 long decode")
