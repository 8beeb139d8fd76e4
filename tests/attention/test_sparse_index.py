"""DeepSeek sparse attention's selection as the latent attention reads it: each query attends the causal keys
among those its indexer selected (positions; -1 pads a query with fewer candidates than `index_topk`)."""

from __future__ import annotations

import torch

from transformers_cb.attention.families.sparse_index import selected_mask


def test_a_query_attends_only_its_selected_causal_keys() -> None:
    # Rows 2..3 of the step: a request's queries at positions 4 and 5 over its keys 0..5.
    indices = torch.tensor([[[0, 1, -1], [9, 9, 9], [1, 3, 5], [0, 2, 4]]], dtype=torch.int32)
    mask = selected_mask(indices, slice(2, 4), 4, 6)
    assert mask.shape == (1, 1, 2, 6)
    # Position 4 selected 1, 3 and 5: 5 is after it (causal), so 1 and 3.
    assert mask[0, 0, 0].tolist() == [False, True, False, True, False, False]
    assert mask[0, 0, 1].tolist() == [True, False, True, False, True, False]


def test_padding_selects_nothing_and_never_spills_onto_key_zero() -> None:
    indices = torch.tensor([[[2, -1, -1]]], dtype=torch.int32)
    assert selected_mask(indices, slice(0, 1), 3, 4)[0, 0, 0].tolist() == [False, False, True, False]
