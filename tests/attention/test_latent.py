"""attention/families/latent.py: multi-latent attention over latent pages, against the module's own decompressed
attention; the pass-through of `expand_kv` for a run; the check of a module's decompression."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

from transformers_cb.attention.families.latent import (
    absorbed_weights,
    latent_attention,
    latent_module_problem,
    latent_modules,
    latent_pass_through,
)
from transformers_cb.attention.native.kernel import native_module
from transformers_cb.attention.paged import step_metadata
from transformers_cb.kv.layer_groups import FULL_ATTENTION, KVGroupSpec
from transformers_cb.memory.kv_cache import PagedKVCache
from transformers_cb.requests import PageList, Request
from transformers_cb.runner.packing import BatchPacker
from transformers_cb.scheduler.step_plan import ScheduledRequest, StepPlan

RANK, ROPE, NOPE, V_DIM, HEADS = 16, 4, 8, 6, 4


def _module(seed: int = 0) -> DeepseekV3Attention:
    config = AutoConfig.for_model(
        "deepseek_v3",
        hidden_size=32,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        kv_lora_rank=RANK,
        qk_rope_head_dim=ROPE,
        qk_nope_head_dim=NOPE,
        v_head_dim=V_DIM,
        q_lora_rank=None,
    )
    torch.manual_seed(seed)
    return DeepseekV3Attention(config, layer_idx=0).eval()


def _step(seqs: list[tuple[int, int]], page_size: int, native: bool, seed: int = 0):
    """A one-layer latent cache with random rows for each request's past tokens, its requests on shuffled
    pages, and the packer's metadata; plus each request's full latent rows (past + new) in token order."""
    generator = torch.Generator().manual_seed(seed)
    counts = [math.ceil((past + q) / page_size) for past, q in seqs]
    num_pages = sum(counts) + 2
    group = KVGroupSpec(FULL_ATTENTION, (0,), head_shape=(1, RANK + ROPE), latent=(RANK, ROPE))
    cache = PagedKVCache(1, num_pages, page_size, 1, RANK + ROPE, torch.float32, torch.device("cpu"), [group])
    permutation = torch.randperm(num_pages, generator=generator).tolist()
    requests, entries, rows, offset = [], [], [], 0
    for i, ((past, q), count) in enumerate(zip(seqs, counts, strict=True)):
        request = Request(
            request_id=f"r{i}", prompt_ids=[1000 * (i + 1) + t for t in range(past + q)], max_new_tokens=1
        )
        pages = permutation[offset : offset + count]
        offset += count
        request.pages = [PageList(pages)]
        request.num_computed_tokens = past
        full = torch.randn(past + q, RANK + ROPE, generator=generator)
        slots = (
            torch.tensor(pages)[torch.arange(past) // page_size] * page_size + torch.arange(past) % page_size
        )
        cache.keys[0][slots, 0] = full[:past]
        requests.append(request)
        entries.append(ScheduledRequest(request, past, q))
        rows.append(full)
    packer = BatchPacker(cache, max(counts), torch.device("cpu"), native=native)
    step = packer.pack(StepPlan(entries=entries))
    cu = step.metadata.cu_seqlens_q.tolist()
    order = [int(step.input_ids[0, cu[j]]) // 1000 - 1 for j in range(len(seqs))]
    return cache, step.metadata, rows, order


def _expected(module, query_rows: torch.Tensor, rows: torch.Tensor, past: int, scale: float) -> torch.Tensor:
    """The module's own attention: every latent decompressed by its `expand_kv`, causal from `past`."""
    key, value = module.expand_kv(rows[None, None, :, :RANK], rows[None, None, :, RANK:])  # [1, H, L, *]
    q = query_rows.transpose(0, 1)[None]  # [1, H, Q, nope + rope]
    length, q_len = rows.shape[0], query_rows.shape[0]
    mask = torch.arange(length)[None, :] <= (past + torch.arange(q_len))[:, None]
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scale)
    return out[0].transpose(0, 1)  # [Q, H, v]


@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
@pytest.mark.parametrize(
    "seqs",
    [[(0, 7)], [(5, 1), (9, 1), (0, 1)], [(6, 1), (0, 5), (3, 4), (11, 1)]],
    ids=["prefill", "decodes", "mixed"],
)
def test_latent_attention_equals_the_decompressed_attention(seqs, native: bool) -> None:
    if native and native_module() is None:
        pytest.skip("the native CPU kernel is not built here")
    module = _module()
    cache, metadata, rows, order = _step(seqs, 4, native)
    generator = torch.Generator().manual_seed(1)
    queries = [torch.randn(q, HEADS, NOPE + ROPE, generator=generator) for _, q in seqs]
    packed_q = torch.cat([queries[i] for i in order])  # [T, H, D]
    packed_new = torch.cat([rows[i][seqs[i][0] :] for i in order])  # [T, RANK + ROPE]
    scale = 0.3
    with torch.no_grad():
        out = latent_attention(
            module,
            packed_q.transpose(0, 1)[None],
            packed_new[None, None, :, :RANK],
            packed_new[None, None, :, RANK:],
            0,
            metadata,
            scale,
        )
        start = 0
        for i in order:
            past, q = seqs[i]
            expected = _expected(module, queries[i], rows[i], past, scale)
            torch.testing.assert_close(out[0, start : start + q], expected, rtol=1e-5, atol=1e-5)
            start += q
    # The step's new rows are in the pages, as latent rows (nothing decompressed is stored).
    assert cache.group_tensors[0].shape == (1, 1, cache.layout.pages[0], 4, 1, RANK + ROPE)


def test_decompressed_kv_is_refused() -> None:
    module = _module()
    cache, metadata, _, _ = _step([(0, 3)], 4, False)
    q = torch.randn(1, HEADS, 3, NOPE + ROPE)
    with pytest.raises(ValueError, match="caches a latent of 16 \\+ 4 values per token"):
        latent_attention(
            module,
            q,
            torch.randn(1, HEADS, 3, NOPE + ROPE),
            torch.randn(1, HEADS, 3, V_DIM),
            0,
            metadata,
            1.0,
        )


def test_absorbed_weights_are_kv_b_proj_per_head() -> None:
    module = _module()
    w_uk, w_uv = absorbed_weights(module)
    latent = torch.randn(1, 1, 5, RANK)
    key, value = module.expand_kv(latent, torch.zeros(1, 1, 5, ROPE))
    torch.testing.assert_close(key[0, :, :, :NOPE], torch.einsum("lr,hnr->hln", latent[0, 0], w_uk))
    torch.testing.assert_close(value[0], torch.einsum("lr,hvr->hlv", latent[0, 0], w_uv))


def test_the_pass_through_is_installed_for_the_block_and_a_step_only() -> None:
    """Handed through inside a continuous-batching forward (the runner's step metadata set in this
    thread); decompressed anywhere else, even inside the block (a plain generate() during a run)."""
    parent = torch.nn.Module()
    parent.attn = _module()
    module = parent.attn
    assert latent_modules(parent) == [module]
    latent, rope = torch.randn(1, 1, 2, RANK), torch.randn(1, 1, 2, ROPE)
    _, metadata, _, _ = _step([(0, 2)], 4, False)
    with latent_pass_through(parent):
        with latent_pass_through(parent):  # nested: nothing more installed, nothing removed early
            pass
        with step_metadata(metadata):
            assert module.expand_kv(latent, rope) == (latent, rope)
        key, _ = module.expand_kv(latent, rope)
        assert key.shape == (1, HEADS, 2, NOPE + ROPE)
    assert "expand_kv" not in module.__dict__
    with step_metadata(metadata):
        key, _ = module.expand_kv(latent, rope)
    assert key.shape == (1, HEADS, 2, NOPE + ROPE)


class _OtherSplit(DeepseekV3Attention):
    """An MLA module whose decompression puts V before K: the absorbed attention would read it wrong."""

    def expand_kv(self, kv_nope, k_rot):
        key, value = super().expand_kv(kv_nope.flip(-1), k_rot)
        return key, value


def test_a_module_decompressing_otherwise_is_named() -> None:
    assert latent_module_problem(_module()) is None
    module = _module()
    module.__class__ = _OtherSplit
    problem = latent_module_problem(module)
    assert problem is not None and "_OtherSplit.expand_kv decompresses its latent otherwise" in problem
    biased = _module()
    biased.kv_b_proj = torch.nn.Linear(RANK, HEADS * (NOPE + V_DIM), bias=True)
    assert "kv_b_proj is not a Linear without bias" in str(latent_module_problem(biased))


def test_a_bf16_module_passes_the_check() -> None:
    """Rounding in 16 bits is not a layout difference (a real kv_lora_rank: 512)."""
    config = AutoConfig.for_model(
        "deepseek_v3",
        hidden_size=64,
        num_attention_heads=4,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        q_lora_rank=None,
    )
    torch.manual_seed(0)
    module = DeepseekV3Attention(config, layer_idx=0).to(torch.bfloat16)
    assert latent_module_problem(module) is None
