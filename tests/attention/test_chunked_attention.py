"""Chunked attention (Llama 4's `attention_chunk_size`) in every paged kernel, against the reference oracle.

A query at position q of a chunked layer attends keys [q // C * C, q]. The steps below put chunk
boundaries inside a prefill chunk, on and across page boundaries, and decodes at a chunk's first token
(one key) and last; the requests hold only their current chunk's pages, in a ring (`ChunkedAttentionPolicy`).
"""

from __future__ import annotations

import pytest
import torch

from tests.support import flash_double
from tests.support.models import build_tiny_model
from tests.support.packed_steps import KernelStep, build_kernel_step
from transformers_cb.attention.backends.eager import eager_attend
from transformers_cb.attention.backends.flash_kernels import FA2
from transformers_cb.attention.backends.sdpa import sdpa_attend
from transformers_cb.attention.families.temperature import retuned_query, scales
from transformers_cb.attention.metadata import first_visible_key, visible_keys
from transformers_cb.attention.native.kernel import ensure_native_module
from transformers_cb.attention.paged import paged_attention
from transformers_cb.attention.reference import reference_paged_attention
from transformers_cb.attention.selection import has_chunked_layers, paged_implementation_for

CHUNK = 6  # not a multiple of the page size: chunks start mid-page
ATTENDS = {"sdpa": sdpa_attend, "eager": eager_attend, "native": sdpa_attend}
CASES = {
    # (past_len, q_len) per request
    "decode_first_token_of_a_chunk": [(2 * CHUNK, 1), (CHUNK, 1)],
    "decode_last_token_of_a_chunk": [(2 * CHUNK - 1, 1), (CHUNK - 1, 1), (3, 1)],
    "first_chunk_crosses_two_boundaries": [(0, 3 * CHUNK - 2)],
    "later_chunk_crosses_a_boundary_mid_page": [(CHUNK - 2, 7), (4 * CHUNK + 1, 2 * CHUNK)],
    "chunk_starts_on_a_boundary": [(2 * CHUNK, CHUNK + 1)],
    "mixed": [(17, 1), (0, 5), (CHUNK + 1, 9), (40, 1), (3, 1), (0, 2 * CHUNK + 3), (29, 1)],
}


def _run(step: KernelStep, kernel: str) -> torch.Tensor:
    return paged_attention(step.query, step.key, step.value, 0, step.metadata, step.scale, ATTENDS[kernel])[0]


def _reference(step: KernelStep, chunk_size: int | None) -> torch.Tensor:
    """The oracle over the requests' own page lists (every page each wrote), in packed order."""
    metadata = step.metadata
    keys, values = step.cache.layer(0)
    width = max(len(pages) for pages in step.all_page_ids)
    block_table = torch.zeros(len(step.seqs), width, dtype=torch.int32)
    for row, i in enumerate(step.packed_order):
        block_table[row, : len(step.all_page_ids[i])] = torch.tensor(step.all_page_ids[i])
    return reference_paged_attention(
        step.query[0].transpose(0, 1),
        keys,
        values,
        metadata.cu_seqlens_q,
        metadata.seq_lens_k,
        block_table,
        step.page_size,
        step.scale,
        chunk_size=chunk_size,
    )


@pytest.mark.parametrize("kernel", sorted(ATTENDS))
@pytest.mark.parametrize("page_size", [4, 8])
@pytest.mark.parametrize("case", sorted(CASES))
def test_chunked_kernels_match_the_reference(case: str, page_size: int, kernel: str) -> None:
    if kernel == "native" and ensure_native_module() is None:
        pytest.skip("the native CPU kernel cannot be built here (see the logged reason)")
    step = build_kernel_step(
        CASES[case], page_size, 8, 2, 16, seed=3, chunk_size=CHUNK, native=kernel == "native"
    )
    if kernel == "native":
        assert step.metadata.native_tokens == step.query.shape[2], "the step did not run in the native kernel"
    assert step.metadata.groups[0].chunk_size == CHUNK
    out = _run(step, kernel)
    torch.testing.assert_close(out, _reference(step, CHUNK), atol=2e-5, rtol=1e-4)
    # The chunk applies: plain causal attention over the same keys differs (every case reads past a chunk
    # boundary somewhere).
    assert not torch.allclose(out, _reference(step, None), atol=1e-3)


@pytest.mark.parametrize("kernel", sorted(ATTENDS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_chunked_kernels_in_low_precision(dtype: torch.dtype, kernel: str) -> None:
    if kernel == "native" and ensure_native_module() is None:
        pytest.skip("the native CPU kernel cannot be built here (see the logged reason)")
    step = build_kernel_step(
        CASES["mixed"], 4, 8, 2, 16, dtype=dtype, seed=5, chunk_size=CHUNK, native=kernel == "native"
    )
    out = _run(step, kernel)
    torch.testing.assert_close(out.float(), _reference(step, CHUNK).float(), atol=2e-2, rtol=2e-2)


def test_the_oracle_applies_the_chunk_rule() -> None:
    """The reference's chunk rule is transformers' `chunked_overlay`: keys of the query's own chunk."""
    positions = torch.arange(20)
    allowed = visible_keys(positions, positions, None, CHUNK)
    for q in range(20):
        expected = [k for k in range(20) if k // CHUNK == q // CHUNK and k <= q]
        assert allowed[q].nonzero().flatten().tolist() == expected
        assert first_visible_key(q, None, CHUNK) == expected[0]


def test_nope_temperature_is_the_tokens_position() -> None:
    """A NoPE layer scales its queries by the temperature of a position it numbers by step index; the glue
    replaces it by the temperature of each token's own position."""

    class NoPE(torch.nn.Module):
        attn_temperature_tuning, use_rope, floor_scale, attn_scale = True, 0, 4, 0.5

    module = NoPE()
    torch.manual_seed(0)
    raw = torch.randn(1, 2, 5, 8)
    positions = torch.tensor([30, 31, 0, 7, 100])
    # What the module hands the attention function: scaled by its step index 0..4.
    applied = (raw * scales(torch.arange(5), 4, 0.5).view(1, 1, -1, 1)).to(raw.dtype)
    expected = raw * scales(positions, 4, 0.5).view(1, 1, -1, 1)
    torch.testing.assert_close(retuned_query(module, applied, positions), expected)
    # With a step shorter than floor_scale the module applied 1 everywhere: the product is exact.
    short = raw[:, :, :2]
    assert torch.equal(
        retuned_query(module, short, positions[:2]), short * scales(positions[:2], 4, 0.5).view(1, 1, -1, 1)
    )


def test_a_chunked_model_never_runs_flash() -> None:
    """Flash kernels have no chunk rule: no auto-switch, and a flash name is refused naming the reason (even
    for a class that would support flash otherwise)."""
    model = build_tiny_model("llama4")
    model._supports_flash_attn = True  # the rule, not the class flag, refuses it
    assert has_chunked_layers(model) and not has_chunked_layers(build_tiny_model("llama"))
    with flash_double.injected(fa2=True, fa3=True):
        assert paged_implementation_for("sdpa", model, auto_switch_to_flash=True, device_type="cpu") == (
            "paged|sdpa"
        )
        with pytest.raises(ValueError, match="chunked-attention layers"):
            paged_implementation_for(FA2, model, device_type="cpu")
