"""engine/weights/pending_decompression.py: a compressed-tensors checkpoint's first-forward hook run by `resolve_settings`
(compressed-tensors need not be installed: the hook is set up as its `add_decompress_hook` does)."""

from __future__ import annotations

import torch
from torch import nn

from transformers_cb.engine.weights.pending_decompression import HOOK_ATTRIBUTE, decompress_pending


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
