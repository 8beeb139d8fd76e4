"""engine/weights/pending_decompression.py: a compressed-tensors checkpoint's first-forward hook run by `resolve_settings`
(compressed-tensors need not be installed: the hook is set up as its `add_decompress_hook` does)."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from transformers_cb.engine.weights.pending_decompression import (
    HOOK_ATTRIBUTE,
    decompress_pending,
    unwrap_weight_only_forwards,
)


def _with_pending_hook(model: nn.Module, calls: list[int]) -> None:
    def hook(module: nn.Module, args: tuple) -> None:
        calls.append(len(args))
        module.decompressed = True
        getattr(module, HOOK_ATTRIBUTE).remove()  # compressed-tensors' hook removes itself

    setattr(model, HOOK_ATTRIBUTE, model.register_forward_pre_hook(hook))


def test_the_pending_hook_runs_once_as_a_first_forward_would() -> None:
    model, calls = nn.Linear(3, 2), []
    _with_pending_hook(model, calls)
    model.forward(torch.zeros(1, 3))  # the engine's call: no hook
    assert calls == []
    assert decompress_pending(model)
    assert calls == [0] and model.decompressed
    assert not decompress_pending(model)  # removed: nothing pending any more
    model(torch.zeros(1, 3))
    assert calls == [0]


def test_a_model_without_the_hook_is_left_alone() -> None:
    model = nn.Linear(3, 2)
    model.register_forward_pre_hook(lambda module, args: None)  # a user's hook: not ours to run
    assert not decompress_pending(model)


def _quantized_forward_linear(input_activations: object, status_name: str = "DECOMPRESSED") -> nn.Linear:
    """A Linear as compressed-tensors' `set_forward_quantized` leaves it: an instance forward wrapping
    `nn.Linear.forward`, a scheme and a status."""
    quantization = pytest.importorskip("compressed_tensors.quantization")
    linear = nn.Linear(4, 4)

    @functools.wraps(nn.Linear.forward)
    def quantized_forward(self: nn.Linear, input: torch.Tensor) -> torch.Tensor:
        return nn.Linear.forward(self, input)

    linear.forward = quantized_forward.__get__(linear)  # type: ignore[method-assign]
    linear.quantization_scheme = SimpleNamespace(input_activations=input_activations, output_activations=None)
    linear.quantization_status = getattr(quantization.QuantizationStatus, status_name)
    return linear


def test_only_a_decompressed_weight_only_quantized_forward_is_dropped() -> None:
    weight_only = _quantized_forward_linear(None)
    activations = _quantized_forward_linear(object())  # W8A8: its forward quantizes the input
    frozen = _quantized_forward_linear(None, "FROZEN")  # not compressed yet: fake-quantizes the weight
    own = nn.Linear(4, 4)
    own.forward = lambda input: input  # type: ignore[method-assign]  # a user's
    model = nn.Sequential(weight_only, activations, frozen, own)
    assert unwrap_weight_only_forwards(model) == 1
    assert "forward" not in weight_only.__dict__
    assert all("forward" in module.__dict__ for module in (activations, frozen, own))
