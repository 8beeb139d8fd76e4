"""memory/weight_key.py: what a tensor's bytes are now, and a model's weights as one fingerprint."""

from __future__ import annotations

import torch

from transformers_cb.memory.weight_key import WeightKey, weights_fingerprint


def test_a_weight_key_changes_with_an_in_place_write_or_new_storage() -> None:
    weight = torch.zeros(4, 3)
    key = WeightKey.of(weight)
    assert WeightKey.of(weight) == key
    with torch.no_grad():
        weight.add_(1.0)
    assert WeightKey.of(weight) != key
    assert WeightKey.of(weight.clone()) != WeightKey.of(weight)  # same values, other storage
    assert WeightKey.of(weight.t()).stride != WeightKey.of(weight).stride


def test_the_fingerprint_covers_every_parameter() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    before = weights_fingerprint(model)
    assert len(before) == 4 and weights_fingerprint(model) == before
    with torch.no_grad():
        model[1].bias.mul_(2.0)
    assert weights_fingerprint(model) != before
