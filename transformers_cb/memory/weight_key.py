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


@dataclass(frozen=True)
class AdapterKey:
    """Which adapters a PEFT layer applies now: the ones active, whether they are disabled, merged, and
    their scales. `set_adapter`, `disable_adapter()`, `set_scale` change the function the model computes
    without writing any parameter, so the parameters' keys alone would let KV computed under one adapter
    be reused under another."""

    active: tuple[str, ...]
    disabled: bool
    merged: tuple[str, ...]
    scaling: tuple[tuple[str, float], ...]

    @staticmethod
    def of(module: torch.nn.Module) -> AdapterKey | None:
        """`module`'s key if it is a PEFT tuner layer or auxiliary wrapper (`modules_to_save`): read by the
        attributes PEFT sets on the instance, so that PEFT need not be installed or imported."""
        state = module.__dict__
        if "_active_adapter" not in state or "_disable_adapters" not in state:
            return None
        active = state["_active_adapter"]
        names = (active,) if isinstance(active, str) else tuple(active or ())
        scaling = getattr(module, "scaling", None)
        scales = (
            tuple(sorted((str(k), float(v)) for k, v in scaling.items())) if isinstance(scaling, dict) else ()
        )
        return AdapterKey(
            names,
            bool(state["_disable_adapters"]),
            tuple(getattr(module, "merged_adapters", ()) or ()),
            scales,
        )


def adapter_keys(model: torch.nn.Module) -> tuple[tuple[str, AdapterKey], ...]:
    """Every PEFT layer's `AdapterKey`, by module name (empty for a model without adapters)."""
    keys = []
    for name, module in model.named_modules():
        key = AdapterKey.of(module)
        if key is not None:
            keys.append((name, key))
    return tuple(keys)


def weights_fingerprint(model: torch.nn.Module) -> tuple[object, ...]:
    """What every parameter is now, and which adapters the PEFT layers apply (`AdapterKey`): changes when
    any weight is written in place or replaced, or another adapter is set, disabled or rescaled (a write
    through `.data` bumps no version counter; such callers say so: `Engine.check_weights(changed=True)`)."""
    return (*(WeightKey.of(p) for p in model.parameters()), adapter_keys(model))
