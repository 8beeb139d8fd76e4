"""memory/weight_key.py: what a tensor's bytes are now, and a model's weights as one fingerprint."""

from __future__ import annotations

import pytest
import torch

from transformers_cb.memory.weight_key import WeightKey, spread_indices, weights_fingerprint


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
    assert sum(isinstance(key, WeightKey) for key in before) == 4 and weights_fingerprint(model) == before
    with torch.no_grad():
        model[1].bias.mul_(2.0)
    assert weights_fingerprint(model) != before


class _AdapterLayer(torch.nn.Linear):
    """What PEFT sets on a tuner layer's instance (read by duck typing: PEFT need not be installed)."""

    def __init__(self) -> None:
        super().__init__(3, 3)
        self._active_adapter = "default"
        self._disable_adapters = False
        self.merged_adapters: list[str] = []
        self.scaling = {"default": 2.0, "other": 1.0}


def test_the_fingerprint_sees_another_adapter_set_disabled_or_rescaled() -> None:
    """`set_adapter` and friends write no parameter: without the adapter keys the engine would reuse KV
    computed under another adapter (conformance/test_peft.py)."""
    model = torch.nn.Sequential(_AdapterLayer(), torch.nn.Linear(3, 2))
    layer = model[0]
    before = weights_fingerprint(model)
    layer._active_adapter = "other"
    assert weights_fingerprint(model) != before
    layer._active_adapter = "default"
    assert weights_fingerprint(model) == before
    layer._disable_adapters = True
    assert weights_fingerprint(model) != before
    layer._disable_adapters = False
    layer.scaling["default"] = 0.5
    assert weights_fingerprint(model) != before


def test_the_fingerprint_sees_a_write_through_data() -> None:
    """`.data` has a version counter of its own: only the sampled values show such a write (a trainer's
    optimizer wrapper writing that way between two runs of a persistent engine)."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    before = weights_fingerprint(model)
    version = model[0].weight._version
    model[0].weight.data.mul_(2.0)
    assert model[0].weight._version == version  # `.data` bumps a counter of its own
    assert weights_fingerprint(model) != before


@pytest.mark.parametrize("numel", [1, 2, 15, 16, 17, 28311552, (1 << 31) + 7])
def test_sample_indices_are_spread_exactly_and_stay_in_range(numel: int) -> None:
    """A float linspace rounded the last index of a 28311552-element embedding past the end (IndexError)."""
    indices = spread_indices(numel, 16, torch.device("cpu")).tolist()
    assert len(indices) == min(numel, 16) and indices[0] == 0 and indices[-1] == numel - 1
    assert indices == sorted(set(indices))


def test_the_fingerprint_sees_a_torchao_weight_replaced_or_rewritten() -> None:
    """A torchao weight is a wrapper (`data_ptr()` 0, a version counter of its own that its parts' writes do
    not bump): the fingerprint reads its int8 data and scales instead."""
    quantization = pytest.importorskip("torchao.quantization", reason="torchao is not installed")
    model = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.Linear(16, 8))
    quantization.quantize_(model, quantization.Int8WeightOnlyConfig())
    before = weights_fingerprint(model)
    assert weights_fingerprint(model) == before
    assert sum(isinstance(key, WeightKey) for key in before) == 2 * 3 + 2  # qdata, scale, zero point; biases
    model[0].weight.qdata.data[0, :4] += 1  # through `.data`: no version moves, the sampled values do
    assert weights_fingerprint(model) != before
    before = weights_fingerprint(model)
    replacement = torch.nn.Linear(32, 16)
    quantization.quantize_(replacement, quantization.Int8WeightOnlyConfig())
    model[0].weight = replacement.weight  # a new quantized weight put in place
    assert weights_fingerprint(model) != before
