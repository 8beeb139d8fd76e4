"""`Sampler` helpers: the greedy choice through `max` equals `argmax`, ties and NaN rows included."""

from __future__ import annotations

import pytest
import torch

from transformers_cb.attention.native import kernel as native
from transformers_cb.sampling.sampler import best_tokens


def test_best_tokens_is_argmax_with_ties_and_nan() -> None:
    generator = torch.Generator().manual_seed(0)
    for n in (7, 4096, 32000):
        scores = torch.randint(0, 4, (16, n), generator=generator).float()  # many ties
        scores[3, 5] = float("nan")
        assert torch.equal(best_tokens(scores), scores.argmax(dim=-1))
        assert torch.equal(best_tokens(scores.bfloat16()), scores.bfloat16().argmax(dim=-1))


def test_greedy_on_bf16_logits_picks_what_float32_picks() -> None:
    # The runner hands the sampler the model's bf16 logits (no float32 copy a step): the hot path's
    # tokens, ties included, and a processed row's, are those of the widened logits.
    from types import SimpleNamespace

    from transformers_cb.sampling.sampler import Sampler

    generator = torch.Generator().manual_seed(1)
    logits = (torch.randint(-8, 8, (32, 49152), generator=generator) / 4).bfloat16()
    logits[:, ::11] = logits.max()  # exact ties at the maximum
    requests = [SimpleNamespace(sampling=None, all_token_ids=[1, 2]) for _ in range(32)]
    sampler = Sampler([], do_sample=False, device=torch.device("cpu"))
    tokens = sampler.sample(logits, requests).tokens
    assert tokens == logits.float().argmax(dim=-1).tolist()


@pytest.mark.skipif(native.ensure_native_module() is None, reason="native library unavailable here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_best_rows_is_torch_max_indices(dtype: torch.dtype) -> None:
    # The native argmax against torch's `max(-1).indices`: ties, NaNs in the vector part and in the tail,
    # -inf rows, signed zeros, rows narrower than a vector, and rows that are slices of wider ones.
    module = native.ensure_native_module()
    generator = torch.Generator().manual_seed(0)
    for width in (1, 7, 8, 9, 15, 16, 17, 24, 31, 32, 33, 47, 64, 100, 4099, 32000):
        wide = torch.randint(-3, 3, (12, width + 5), generator=generator).to(dtype)
        scores = wide[:, 2 : width + 2]  # row stride width + 5
        scores[1] = float("-inf")
        scores[2] = 0.0
        scores[2, width // 2] = -0.0
        scores[2, -1] = -0.0
        scores[3, width // 3] = float("nan")
        scores[4, -1] = float("nan")
        scores[5, width // 2] = float("nan")
        scores[5, width // 4] = float("nan")
        scores[6, -1] = 100.0
        scores[7] = -1.0
        scores[7, -1] = float("-inf")
        out = torch.empty(12, dtype=torch.long)
        module.best_rows(scores, out)
        assert torch.equal(out, scores.max(dim=-1).indices), width
        assert torch.equal(best_tokens(scores), scores.argmax(dim=-1)), width


def test_best_tokens_without_the_native_library(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("transformers_cb.sampling.sampler.native_module", lambda: None)
    scores = torch.tensor([[1.0, 3.0, 3.0], [float("nan"), 1.0, float("nan")]])
    assert best_tokens(scores).tolist() == [1, 0]
    assert best_tokens(scores.half()).tolist() == [1, 0]  # not a native dtype: torch's max
