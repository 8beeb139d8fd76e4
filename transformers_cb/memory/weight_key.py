"""What a tensor's bytes are now (`WeightKey`), and a model's weights as one fingerprint.

Two owners compare them: a packed product's pack (runner/packed_linear.py) is rebuilt when its weight's
key changed, and an engine's prefix cache (`Engine.drop_stale_prefix_cache`) is dropped when the model's
fingerprint did. Neither owns the notion, so it lives here, below both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class WeightKey:
    """What a pack (or an engine's prefix cache) was computed from: any in-place write (version), new
    storage, dtype or layout changes it."""

    version: int
    data_ptr: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @staticmethod
    def of(weight: torch.Tensor) -> WeightKey:
        try:
            version = weight._version
        except RuntimeError:  # an inference tensor keeps no version counter (and cannot be written in place)
            version = -1
        return WeightKey(
            version, weight.data_ptr(), weight.dtype, tuple(weight.shape), tuple(weight.stride())
        )


def weights_fingerprint(model: torch.nn.Module) -> tuple[WeightKey, ...]:
    """What every parameter is now: changes when any weight is written in place or replaced (a write
    through `.data` bumps no version counter; such callers recompute anyway: a fresh engine)."""
    return tuple(WeightKey.of(p) for p in model.parameters())
