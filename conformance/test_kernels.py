"""Every paged kernel against the pure-torch reference kernel, on packed steps built like the engine's.

A step is a `PagedKVCache` with random contents, requests on shuffled non-contiguous pages, and the
`BatchPacker`'s metadata. `paged_attention` writes the step's new K/V, then attends; the reference reads
the same cache afterwards through tables built here from the requests' own page ids (and the packer's
tables are checked equal to those).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conformance.common import TOLERANCES, assert_close
from tests.support import flash_double
from tests.support.packed_steps import KernelStep, build_kernel_step
from transformers_cb.attention import PAGED_BACKENDS
from transformers_cb.attention.backends.eager import eager_attend
from transformers_cb.attention.backends.fast_path import prepare_flash_step
from transformers_cb.attention.backends.flash_kernels import FA3, is_flash_backend
from transformers_cb.attention.backends.sdpa import sdpa_attend
from transformers_cb.attention.families.alibi import bloom_slopes
from transformers_cb.attention.native.kernel import ensure_native_module
from transformers_cb.attention.paged import ALIBI_KWARG, METADATA_KWARG, paged_attention
from transformers_cb.attention.reference import reference_paged_attention
from transformers_cb.runner.call_groups import native_prefill_max_work

ATTENDS = {"sdpa": sdpa_attend, "eager": eager_attend}
# "native": the native CPU kernel for decodes and short chunks, sdpa for the long chunks.
NATIVE = "native"
KERNELS = [*sorted(ATTENDS), NATIVE]


def kernel_step(*args, kernel: str = "sdpa", **kwargs) -> KernelStep:
    """`build_kernel_step`, packed for the native kernel when `kernel` is "native" (skipped when it
    cannot be built on this machine)."""
    if kernel == NATIVE and ensure_native_module() is None:
        pytest.skip("the native CPU kernel cannot be built here (see the logged reason)")
    return build_kernel_step(*args, native=kernel == NATIVE, **kwargs)


# The registered backends run here: the pure-torch ones, and the flash glue through the CPU double of
# flash-attn 3 (tests/support/flash_double.py; flash-attn 2's paged API needs 256-token pages, which the
# model-level tests in tests/attention/test_flash_backends.py use). The hub names share this glue.
BACKENDS = ["paged|eager", "paged|sdpa", FA3]


class _Layer(torch.nn.Module):
    layer_idx = 0


def run_kernel(
    step: KernelStep,
    kernel: str,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """`kernel`: an `attend` name (through `paged_attention`) or a registered backend name (through its
    `attn_implementation` forward, as the model calls it, with the layer's window, softcap and sinks).
    Returns `[1, T, H, D]`."""
    if kernel in ATTENDS or kernel == NATIVE:
        attend = ATTENDS.get(kernel, sdpa_attend)
        return paged_attention(
            step.query, step.key, step.value, 0, step.metadata, step.scale, attend, softcap, sinks, slopes
        )
    if is_flash_backend(kernel):
        with flash_double.injected(fa2=False, fa3=True):
            prepare_flash_step(step.metadata, 0)  # what the runner adds for flash backends
            return _call_backend(step, kernel, softcap, sinks, slopes)
    return _call_backend(step, kernel, softcap, sinks, slopes)


def _call_backend(
    step: KernelStep,
    kernel: str,
    softcap: float | None,
    sinks: torch.Tensor | None,
    slopes: torch.Tensor | None = None,
):
    alibi = {} if slopes is None else {ALIBI_KWARG: slopes}
    out, _ = PAGED_BACKENDS[kernel](
        _Layer(),
        step.query,
        step.key,
        step.value,
        None,
        scaling=step.scale,
        sliding_window=step.sliding_window,
        softcap=softcap,
        s_aux=sinks,
        **{METADATA_KWARG: step.metadata},
        **alibi,
    )
    return out


# (num_heads, num_kv_heads, head_dim): MHA, GQA 2, 3 and 4, MQA; head dims 16/32/64/128 (the native
# kernel's compile-time shapes: head dims 64 and 128 with groups up to 8; others take its generic path).
HEADS = [(4, 4, 16), (4, 2, 32), (8, 2, 64), (8, 4, 16), (4, 1, 32), (8, 1, 64), (9, 3, 64), (6, 2, 128)]


def expected_tables(step: KernelStep) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """cu_seqlens_q, seq_lens_k, block_table in packed order, from the requests themselves."""
    q_lens = [step.seqs[i][1] for i in step.packed_order]
    cu_seqlens_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens_k = torch.tensor([sum(step.seqs[i]) for i in step.packed_order], dtype=torch.int32)
    width = max(len(step.all_page_ids[i]) for i in step.packed_order)
    block_table = torch.zeros(len(step.seqs), width, dtype=torch.int32)
    for row, i in enumerate(step.packed_order):
        pages = step.all_page_ids[i]
        block_table[row, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
    return cu_seqlens_q, seq_lens_k, block_table


def check_kernel(
    step: KernelStep,
    kernel: str,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    slopes: torch.Tensor | None = None,
) -> None:
    metadata = step.metadata
    cu_seqlens_q, seq_lens_k, block_table = expected_tables(step)
    assert torch.equal(metadata.cu_seqlens_q.cpu(), cu_seqlens_q), (metadata.cu_seqlens_q, cu_seqlens_q)
    assert torch.equal(metadata.seq_lens_k.cpu(), seq_lens_k), (metadata.seq_lens_k, seq_lens_k)
    for row, i in enumerate(step.packed_order):
        used = -(-int(seq_lens_k[row]) // step.page_size)
        held = step.requests[i].pages[0].first_page  # a sliding request dropped the pages before
        assert torch.equal(
            metadata.groups[0].block_table[row, held:used].cpu(), block_table[row, held:used]
        ), f"row {row}"
    assert metadata.max_seqlen_q == max(q for _, q in step.seqs)
    assert metadata.max_seqlen_k == max(p + q for p, q in step.seqs)

    out = run_kernel(step, kernel, softcap, sinks, slopes)  # [1, T, H, D]
    assert out.shape == (1, step.query.shape[2], step.query.shape[1], step.query.shape[3])

    # The new K/V landed exactly at the requests' own slots, and nothing else changed.
    keys, values = step.cache.layer(0)
    new_keys = step.key[0].transpose(0, 1)  # [T, Hkv, D]
    new_values = step.value[0].transpose(0, 1)
    expected_keys = step.initial_keys.clone()
    for row, i in enumerate(step.packed_order):
        past, q = step.seqs[i]
        rows = slice(int(cu_seqlens_q[row]), int(cu_seqlens_q[row + 1]))
        slots = step.slots(i, past + q)[past:]
        assert torch.equal(keys[slots], new_keys[rows]), f"request {i}: new keys not at its slots"
        assert torch.equal(values[slots], new_values[rows]), f"request {i}: new values not at its slots"
        expected_keys[slots] = new_keys[rows]
    assert torch.equal(keys, expected_keys), "the step wrote K outside its new tokens' slots"

    expected = reference_paged_attention(
        step.query[0].transpose(0, 1),
        keys,
        values,
        cu_seqlens_q,
        seq_lens_k,
        block_table,
        step.page_size,
        step.scale,
        step.sliding_window,
        softcap,
        sinks,
        slopes=slopes,
    )
    atol, rtol = TOLERANCES[step.query.dtype]
    shape = f"seqs={step.seqs} packed_order={step.packed_order} page_size={step.page_size}"
    heads = f"H={step.query.shape[1]} Hkv={step.key.shape[1]} D={step.query.shape[3]} {step.query.dtype}"
    assert_close(out[0], expected, atol, rtol, msg=f"{kernel} vs reference, {shape}, {heads}")
    # The reference fed with the packer's own tables agrees too.
    from_metadata = reference_paged_attention(
        step.query[0].transpose(0, 1),
        keys,
        values,
        metadata.cu_seqlens_q,
        metadata.seq_lens_k,
        metadata.groups[0].block_table,
        step.page_size,
        step.scale,
        step.sliding_window,
        softcap,
        sinks,
        slopes=slopes,
    )
    assert torch.equal(from_metadata, expected)


P = 8  # page size of the hand-written cases
CASES = {
    "decode_kv1": [(0, 1)],
    "decode_kv_multiple_of_page": [(2 * P - 1, 1)],
    "decode_opens_new_page": [(2 * P, 1)],
    "prefill_exactly_one_page": [(0, P)],
    "prefill_three_pages": [(0, 3 * P)],
    "prefill_partial_page": [(0, P + 3)],
    "chunk_starts_mid_page": [(P + 3, P + 2)],
    "chunk_starts_on_page_boundary": [(2 * P, P)],
    "chunk_ends_on_page_boundary": [(3, 2 * P - 3)],
    "one_token_chunk_mid_prompt": [(5, 1), (P, 1)],
    "equal_decodes_no_padding": [(20, 1), (20, 1), (20, 1)],
    "mixed_decode_groups_and_chunks": [
        (3, 1),
        (P + 3, P + 2),
        (100, 1),
        (0, 7),
        (90, 1),
        (20, 1),
        (4, 1),
        (2 * P, P),
        (4, 1),
        (31, 1),
    ],
    # Short chunks join the native run (float32: up to 512 x 512 (query, key) pairs)...
    "short_chunks_joined": [(3, 1), (0, 70), (10, 5), (P, 80), (50, 1), (0, 2)],
    # ...chunks with more than `native_prefill_max_work` pairs stay on sdpa / eager after the native run.
    "long_chunks_after_short_ones": [(3, 1), (0, 520), (10, 5), (P, 530), (50, 1), (0, 2)],
}


@pytest.mark.parametrize("attend_name", KERNELS)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"H{h[0]}-Hkv{h[1]}-D{h[2]}")
@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_matches_reference(case: str, heads: tuple[int, int, int], attend_name: str) -> None:
    num_heads, num_kv_heads, head_dim = heads
    step = kernel_step(
        CASES[case], P, num_heads, num_kv_heads, head_dim, seed=sorted(CASES).index(case), kernel=attend_name
    )
    check_kernel(step, attend_name)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "case", ["decode_kv_multiple_of_page", "chunk_starts_mid_page", "mixed_decode_groups_and_chunks"]
)
def test_registered_backend_matches_reference(case: str, backend: str) -> None:
    """Every registered `paged|...` attention function, called as the model calls it."""
    step = build_kernel_step(CASES[case], P, 8, 2, 32, seed=3)
    check_kernel(step, backend)


@pytest.mark.parametrize("attend_name", KERNELS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("page_size", [4, 16])
def test_kernel_low_precision(page_size: int, dtype: torch.dtype, attend_name: str) -> None:
    """bf16 / fp16 caches, the native kernel included (it reads them as they are, accumulates in float32)."""
    seqs = [(37, 1), (5, 1), (page_size + 1, 2 * page_size), (0, 9), (60, 1)]
    step = kernel_step(seqs, page_size, 8, 2, 32, dtype=dtype, seed=7, kernel=attend_name)
    check_kernel(step, attend_name)
    if attend_name == NATIVE:  # the decodes and the short chunks ran in the kernel, in this dtype
        bound = native_prefill_max_work(dtype)
        native = sum(q for past, q in seqs if q == 1 or q * (past + q) <= bound)
        assert step.metadata.native_tokens == native == sum(q for _, q in seqs)


@st.composite
def step_shapes(draw) -> tuple:
    page_size = draw(st.sampled_from([4, 8, 16]))
    heads = draw(st.sampled_from(HEADS))
    seqs = []
    for _ in range(draw(st.integers(1, 8))):
        kind = draw(st.sampled_from(["decode", "first_chunk", "later_chunk"]))
        aligned = draw(st.booleans())
        past = 0 if kind == "first_chunk" else draw(st.integers(0 if kind == "decode" else 1, 80))
        if aligned and past:
            past = max(page_size, past - past % page_size)  # starts exactly on a page boundary
        q_len = 1 if kind == "decode" else draw(st.integers(2, 40))
        seqs.append((past, q_len))
    seed = draw(st.integers(0, 2**16))
    attend = draw(st.sampled_from(KERNELS))
    return seqs, page_size, heads, seed, attend


@settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(step_shapes())
def test_kernel_matches_reference_random_steps(shape) -> None:
    seqs, page_size, (num_heads, num_kv_heads, head_dim), seed, attend_name = shape
    step = kernel_step(seqs, page_size, num_heads, num_kv_heads, head_dim, seed=seed, kernel=attend_name)
    check_kernel(step, attend_name)


# -- sliding windows, softcapping, sinks ------------------------------------------------------------
W = 6  # window of the hand-written sliding cases: not a multiple of the page size
SLIDING_CASES = {
    "decode_before_window_fills": [(3, 1)],
    "decode_window_exactly_full": [(W - 1, 1)],
    "decode_long_past_window": [(5 * P + 3, 1), (40, 1), (W, 1)],
    "first_chunk_longer_than_window": [(0, 3 * P + 1)],
    "chunk_crosses_window_boundary": [(W - 2, 5)],
    "chunk_far_past_window": [(4 * P + 1, 2 * P + 3)],
    "mixed": [(3, 1), (P + 3, P + 2), (100, 1), (0, 17), (90, 1), (2 * P, P), (31, 1)],
}


def _sinks(num_heads: int, seed: int) -> torch.Tensor:
    return torch.randn(num_heads, generator=torch.Generator().manual_seed(seed)) * 2


@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("kernel", [*KERNELS, *BACKENDS])
@pytest.mark.parametrize("variant", ["window", "window+softcap", "window+sinks", "softcap", "sinks"])
@pytest.mark.parametrize("case", sorted(SLIDING_CASES))
def test_window_softcap_sinks_match_reference(case: str, variant: str, kernel: str, head_dim: int) -> None:
    """Per layer: a sliding window (pages before it dropped, ring block table), logit softcapping
    (sdpa takes the eager path) and attention sinks, each against the reference kernel."""
    window = W if "window" in variant else None
    step = kernel_step(
        SLIDING_CASES[case],
        P,
        8,
        2,
        head_dim,
        seed=sorted(SLIDING_CASES).index(case),
        sliding_window=window,
        kernel=kernel,
    )
    softcap = 0.7 if "softcap" in variant else None  # small: tanh saturates, so a skipped cap shows
    sinks = _sinks(8, seed=1) if "sinks" in variant else None
    if sinks is not None and is_flash_backend(kernel):
        with pytest.raises(NotImplementedError, match="takes no attention sinks"):
            run_kernel(step, kernel, softcap, sinks)  # flash-attn 3 has no sinks: refused, never ignored
        return
    check_kernel(step, kernel, softcap, sinks)


@pytest.mark.parametrize("kernel", [*KERNELS, *BACKENDS])
@pytest.mark.parametrize("variant", ["full", "window"])
@pytest.mark.parametrize("case", sorted(SLIDING_CASES))
def test_alibi_matches_reference(case: str, variant: str, kernel: str) -> None:
    """ALiBi (Bloom's slopes of 6 heads: not a power of two) in every kernel, against the reference's
    `slope * (key_pos - query_pos)`; the paged flash kernels refuse it, never ignore it."""
    step = kernel_step(
        SLIDING_CASES[case],
        P,
        6,
        2,
        16,
        seed=sorted(SLIDING_CASES).index(case),
        sliding_window=W if variant == "window" else None,
        kernel=kernel,
    )
    slopes = bloom_slopes(6) * 4  # steeper than Bloom's, so that a bias off by one position shows
    if is_flash_backend(kernel):
        with pytest.raises(NotImplementedError, match="ALiBi"):
            run_kernel(step, kernel, slopes=slopes)
        return
    check_kernel(step, kernel, slopes=slopes)


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(step_shapes(), st.integers(1, 40), st.booleans(), st.booleans())
def test_sliding_kernel_matches_reference_random_steps(
    shape, window: int, softcap: bool, sinks: bool
) -> None:
    seqs, page_size, (num_heads, num_kv_heads, head_dim), seed, attend_name = shape
    step = kernel_step(
        seqs,
        page_size,
        num_heads,
        num_kv_heads,
        head_dim,
        seed=seed,
        sliding_window=window,
        kernel=attend_name,
    )
    check_kernel(step, attend_name, 1.5 if softcap else None, _sinks(num_heads, seed) if sinks else None)


def test_layer_window_must_match_its_kv_group() -> None:
    """A layer asking for another window than its group keeps pages for is refused, not run wrongly."""
    step = build_kernel_step([(20, 1)], P, 4, 2, 16, sliding_window=W)
    with pytest.raises(
        ValueError, match="sliding_window=7 but its KV cache group was built for sliding_window=6"
    ):
        PAGED_BACKENDS["paged|sdpa"](
            _Layer(),
            step.query,
            step.key,
            step.value,
            None,
            sliding_window=7,
            **{METADATA_KWARG: step.metadata},
        )
    full = build_kernel_step([(20, 1)], P, 4, 2, 16)
    with pytest.raises(
        ValueError, match="sliding_window=6 but its KV cache group was built for sliding_window=None"
    ):
        PAGED_BACKENDS["paged|eager"](
            _Layer(),
            full.query,
            full.key,
            full.value,
            None,
            sliding_window=W,
            **{METADATA_KWARG: full.metadata},
        )
