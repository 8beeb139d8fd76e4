"""Shared helpers of the conformance suite: references, parity checks, kernel steps (the tiny models
and prompts are in tests/support/)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
import torch
from transformers import GenerationConfig, PreTrainedModel

import transformers_cb  # noqa: F401  (installs the plugin)
from transformers_cb.attention.metadata import AttentionMetadata
from transformers_cb.kv.layer_groups import SLIDING_ATTENTION, KVGroupSpec
from transformers_cb.memory.kv_cache import PagedKVCache
from transformers_cb.requests import GenerationOutput, PageList, Request, RequestStatus
from transformers_cb.runner.packing import BatchPacker
from transformers_cb.scheduler.plan import ScheduledRequest, StepPlan
from transformers_cb.tools.conformance_check import (
    Mismatch,
    compare_tokens,
    count_preemptions,
    first_difference,
    greedy_config,
    reference_greedy,
)

__all__ = [
    "Mismatch",
    "compare_tokens",
    "count_preemptions",
    "first_difference",
    "greedy_config",
    "reference_greedy",
]


class ReferenceCache:
    """`generate()` outputs per (prompt, eos), computed once with max_new_tokens = `max_new_tokens`.

    With eos disabled, greedy decoding of k tokens is the first k tokens of decoding more,
    so shorter requests are served from the prefix.
    """

    def __init__(self, model: PreTrainedModel, max_new_tokens: int) -> None:
        self.model = model
        self.max_new_tokens = max_new_tokens
        self._cache: dict[tuple, list[int]] = {}

    def get(
        self,
        prompt: Sequence[int],
        max_new_tokens: int | None = None,
        eos_token_id: int | list[int] | None = None,
    ) -> list[int]:
        max_new_tokens = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        assert max_new_tokens <= self.max_new_tokens
        if eos_token_id is not None:  # eos outputs are not prefix-closed in max_new_tokens
            eos_key = tuple(eos_token_id) if isinstance(eos_token_id, list) else eos_token_id
            key = (tuple(prompt), max_new_tokens, eos_key)
            if key not in self._cache:
                self._cache[key] = self._generate(prompt, max_new_tokens, eos_token_id)
            return self._cache[key]
        key = (tuple(prompt), self.max_new_tokens, None)
        if key not in self._cache:
            self._cache[key] = self._generate(prompt, self.max_new_tokens, None)
        return self._cache[key][:max_new_tokens]

    def _generate(self, prompt: Sequence[int], max_new_tokens: int, eos_token_id) -> list[int]:
        saved = self.model.generation_config.eos_token_id
        self.model.generation_config.eos_token_id = eos_token_id
        try:
            return reference_greedy(self.model, prompt, greedy_config(max_new_tokens, eos_token_id))
        finally:
            self.model.generation_config.eos_token_id = saved


def check_parity(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    outputs: dict[str, GenerationOutput],
    references: Sequence[Sequence[int]],
    context: str = "",
    max_new_tokens: int | Sequence[int] | None = None,
    eos_token_id: int | list[int] | None = None,
) -> None:
    """Fail on any difference with generate() that is not a genuine floating-point near-tie.

    Tie-aware: where the outputs part at a near-tie (the reference's top-2 logits within the
    tolerance), the divergence is accepted and the rest of the output is checked against `generate()`
    continued from the same prefix (the output's own tokens up to and including the tie). So the test
    passes or fails on real differences only, and never hides one behind an `xfail`.
    `max_new_tokens` (default: each reference's length) and `eos_token_id` are those of the requests,
    for the continuations. Request ids are `req_<index>`."""
    expected_ids = [f"req_{i}" for i in range(len(prompts))]
    assert sorted(outputs) == sorted(expected_ids), f"{context}: ids {sorted(outputs)} != {expected_ids}"
    if max_new_tokens is None or isinstance(max_new_tokens, int):
        limits = [max_new_tokens or len(ref) for ref in references]
    else:
        limits = list(max_new_tokens)
    failures = []
    for i, (prompt, expected) in enumerate(zip(prompts, references, strict=True)):
        output = outputs[f"req_{i}"]
        assert output.status == RequestStatus.FINISHED, (
            f"{context}: req_{i} ended {output.status.name}: {output.error}"
        )
        assert output.prompt_ids == list(prompt), f"{context}: req_{i} prompt_ids changed"
        mismatch, ties = tie_aware_mismatch(
            model, f"req_{i}", prompt, expected, output.generated_tokens, limits[i], eos_token_id
        )
        if mismatch is not None:
            failures.append("\n\n".join(m.describe() for m in [mismatch, *ties]))
    if failures:
        pytest.fail(f"{context}\n" + "\n\n".join(failures), pytrace=False)


def tie_aware_mismatch(
    model: PreTrainedModel,
    request_id: str,
    prompt: Sequence[int],
    expected: Sequence[int],
    actual: Sequence[int],
    max_new_tokens: int,
    eos_token_id: int | list[int] | None = None,
) -> tuple[Mismatch | None, list[Mismatch]]:
    """(first real mismatch or None, the near-ties accepted on the way). At each near-tie the reference
    becomes `actual[: index + 1]` + greedy `generate()` continued from there."""
    ties: list[Mismatch] = []
    eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
    expected = list(expected)
    while True:
        mismatch = compare_tokens(model, request_id, prompt, expected, actual)
        if mismatch is None or not mismatch.is_near_tie:
            return mismatch, ties
        ties.append(mismatch)
        prefix = list(actual[: mismatch.index + 1])
        remaining = max_new_tokens - len(prefix)
        continuation: list[int] = []
        if remaining > 0 and prefix[-1] not in eos:
            continuation = reference_greedy(model, [*prompt, *prefix], greedy_config(remaining, eos_token_id))
        expected = prefix + continuation


def run_batch(
    model: PreTrainedModel,
    prompts,
    generation_config: GenerationConfig,
    max_new_tokens: int | list[int] | None = None,
    **cb_kwargs,
):
    """`generate_batch` with `ContinuousBatchingConfig(**cb_kwargs)`; returns (outputs, preempted ids)."""
    from transformers_cb import ContinuousBatchingConfig

    kwargs = {} if max_new_tokens is None else {"max_new_tokens": max_new_tokens}
    with count_preemptions() as preemptions:
        outputs = model.generate_batch(
            [list(p) for p in prompts],
            generation_config=generation_config,
            continuous_batching_config=ContinuousBatchingConfig(**cb_kwargs),
            progress_bar=False,
            **kwargs,
        )
    return outputs, preemptions


def tight_num_blocks(prompts: Sequence[Sequence[int]], max_new_tokens: int, page_size: int) -> int:
    """Just enough pages for the largest single request, plus one."""
    return math.ceil((max(map(len, prompts)) + max_new_tokens) / page_size) + 1


# -- tensors ----------------------------------------------------------------------------------------
def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float, msg: str = ""
) -> None:
    """`torch.testing`-style closeness, with max/mean abs diff and the worst index in the message."""
    assert actual.shape == expected.shape, f"{msg}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    actual, expected = actual.float(), expected.float()
    assert torch.isfinite(actual).all(), f"{msg}: non-finite values in the result"
    diff = (actual - expected).abs()
    bad = diff > atol + rtol * expected.abs()
    if bad.any():
        worst = int(diff.argmax())
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), diff.shape))
        raise AssertionError(
            f"{msg}: {int(bad.sum())}/{diff.numel()} elements differ beyond atol={atol:g} rtol={rtol:g}; "
            f"max abs diff {diff.max().item():.3g} at {index} "
            f"(actual {actual[index].item():.6g}, expected {expected[index].item():.6g}), "
            f"mean abs diff {diff.mean().item():.3g}"
        )


TOLERANCES = {torch.float32: (2e-5, 2e-4), torch.bfloat16: (3e-2, 3e-2), torch.float16: (5e-3, 5e-3)}


@dataclass
class KernelStep:
    """One random packed step: a cache with random contents, its requests and the packer's metadata.

    `packed_rows[i]` is the index (into `seqs`) of the request at packed position `i`;
    `query`/`key`/`value` are in packed order.
    """

    cache: PagedKVCache
    metadata: AttentionMetadata
    requests: list[Request]
    seqs: list[tuple[int, int]]  # (past_len, q_len) per request, in submission order
    packed_order: list[int]
    query: torch.Tensor  # [1, H, T, D]
    key: torch.Tensor  # [1, Hkv, T, D]
    value: torch.Tensor
    page_size: int
    scale: float
    initial_keys: torch.Tensor = field(repr=False, default=None)
    # Every page each request's tokens were written to (a sliding request has dropped the first ones).
    all_page_ids: list[list[int]] = field(default_factory=list)
    sliding_window: int | None = None

    def slots(self, request_index: int, length: int) -> torch.Tensor:
        """Cache slots of tokens [0, length) of request `request_index`, from its page ids."""
        positions = torch.arange(length)
        pages = torch.tensor(self.all_page_ids[request_index])[positions // self.page_size]
        return pages * self.page_size + positions % self.page_size


def build_kernel_step(
    seqs: Sequence[tuple[int, int]],
    page_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    spare_pages: int = 3,
    sliding_window: int | None = None,
    native: bool = False,
) -> KernelStep:
    """Requests with (past_len, q_len) each, on shuffled non-contiguous pages, packed by `BatchPacker`.

    Every request's prompt tokens are unique to it, so the packed order is read back from `input_ids`.
    With `sliding_window`, the layer is in a sliding group: each request holds only the pages from its
    window on (as `SlidingWindowPolicy.trim` leaves them) in a block-table ring just wide enough.
    With `native`, the packer hands the decodes and short chunks to the native CPU kernel.
    """
    generator = torch.Generator().manual_seed(seed)
    num_pages_each = [math.ceil((past + q) / page_size) for past, q in seqs]
    num_pages = sum(num_pages_each) + spare_pages
    groups = widths = None
    if sliding_window is not None:
        groups = [KVGroupSpec(SLIDING_ATTENTION, (0,), sliding_window)]
        max_q = max(q for _, q in seqs)
        widths = [min(max(num_pages_each), math.ceil((sliding_window - 1 + max_q) / page_size) + 1)]
    cache = PagedKVCache(1, num_pages, page_size, num_kv_heads, head_dim, dtype, torch.device("cpu"), groups)
    cache.keys[0].copy_(torch.randn(cache.keys[0].shape, generator=generator))
    cache.values[0].copy_(torch.randn(cache.values[0].shape, generator=generator))
    initial_keys = cache.keys[0].clone()
    permutation = torch.randperm(num_pages, generator=generator).tolist()
    requests, entries, all_page_ids, offset = [], [], [], 0
    for i, ((past, q), count) in enumerate(zip(seqs, num_pages_each, strict=True)):
        tokens = [1000 * (i + 1) + t for t in range(past + q)]  # unique per request
        request = Request(request_id=f"r{i}", prompt_ids=tokens, max_new_tokens=1)
        all_page_ids.append(permutation[offset : offset + count])
        first = 0 if sliding_window is None else max(0, past - sliding_window + 1) // page_size
        request.pages = [PageList(all_page_ids[-1][first:], first_page=first)]
        request.num_computed_tokens = past
        offset += count
        requests.append(request)
        entries.append(ScheduledRequest(request, past, q))
    packer = BatchPacker(cache, widths or max(num_pages_each), torch.device("cpu"), native=native)
    step = packer.pack(StepPlan(entries=entries))
    metadata = step.metadata
    # The packer reorders requests; recover the order from the (unique) token ids.
    cu = metadata.cu_seqlens_q.tolist()
    packed_order = [int(step.input_ids[0, cu[j]]) // 1000 - 1 for j in range(len(seqs))]
    total = sum(q for _, q in seqs)
    query = torch.randn(1, num_heads, total, head_dim, generator=generator).to(dtype)
    key = torch.randn(1, num_kv_heads, total, head_dim, generator=generator).to(dtype)
    value = torch.randn(1, num_kv_heads, total, head_dim, generator=generator).to(dtype)
    return KernelStep(
        cache=cache,
        metadata=metadata,
        requests=requests,
        seqs=list(seqs),
        packed_order=packed_order,
        query=query,
        key=key,
        value=value,
        page_size=page_size,
        scale=head_dim**-0.5,
        initial_keys=initial_keys,
        all_page_ids=all_page_ids,
        sliding_window=sliding_window,
    )
