"""What a tensor's bytes are now (`WeightKey`), and a model's weights as one fingerprint.

Two owners compare them: a packed product's pack (runner/products/packed_linear.py) is rebuilt when its weight's
key changed, and an engine's prefix cache (`Engine.drop_stale_prefix_cache`) is dropped when the model's
fingerprint did. Neither owns the notion, so it lives here, below both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch


class WeightKey(NamedTuple):
    """What a pack (or an engine's prefix cache) was computed from: any in-place write (version), new
    storage, dtype or layout changes it. A named tuple: made and compared for every packed product of a
    step (a frozen dataclass costs several times more to make)."""

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


# Values of each parameter a fingerprint holds (evenly spaced): writes that bump no version counter (through
# `.data`: a trainer's optimizer wrapper) move them; a write to a few values may be missed and is announced.
SAMPLE_SIZE = 16
_sample_indices: dict[tuple[int, torch.device], torch.Tensor] = {}


def _readable(tensor: torch.Tensor) -> bool:
    """Not meta, not a distributed or quantized subclass, not empty: its values can be sampled here."""
    return type(tensor.data) is torch.Tensor and tensor.device.type != "meta" and tensor.numel() > 0


def spread_indices(numel: int, count: int, device: torch.device) -> torch.Tensor:
    """`min(numel, count)` flat indices spread evenly over `[0, numel)`, first and last included, in exact
    integer arithmetic (a float `linspace` rounds the last index past the end from 2^24 elements)."""
    count = min(numel, count)
    if count <= 1:
        return torch.zeros(count, dtype=torch.long, device=device)
    return torch.arange(count, dtype=torch.long, device=device) * (numel - 1) // (count - 1)


def _indices(numel: int, device: torch.device) -> torch.Tensor:
    key = (numel, device)
    indices = _sample_indices.get(key)
    if indices is None:
        indices = spread_indices(numel, SAMPLE_SIZE, device)
        _sample_indices[key] = indices
    return indices


def value_samples(tensors: Sequence[torch.Tensor]) -> bytes:
    """The bytes of `SAMPLE_SIZE` values of each tensor at evenly spaced flat indices (no copy of a tensor;
    one transfer per device); nothing for a tensor whose values cannot be read here (`_readable`)."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in tensors:
        if _readable(tensor):
            sample = torch.take(tensor.detach(), _indices(tensor.numel(), tensor.device))
            by_device.setdefault(tensor.device, []).append(sample.view(torch.uint8))
    return b"".join(bytes(torch.cat(parts).cpu().numpy()) for parts in by_device.values())


def quantized_parts(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors a torchao quantized weight is made of (its int8 data, scales, zero points: they hold
    the bytes, the version counters and the data pointers; the wrapper has none of its own, `data_ptr()` 0),
    `[tensor]` for any other tensor."""
    if type(tensor).__module__.split(".")[0] != "torchao" or not hasattr(tensor, "__tensor_flatten__"):
        return [tensor]
    names, _ = tensor.__tensor_flatten__()
    inner = [getattr(tensor, name) for name in names]
    return [part for t in inner if isinstance(t, torch.Tensor) for part in quantized_parts(t)]


def weights_fingerprint(model: torch.nn.Module) -> tuple[object, ...]:
    """What every parameter is now (key and a sample of its values; a torchao weight's by its parts,
    `quantized_parts`), and which adapters the PEFT layers apply (`AdapterKey`): changes when any weight is
    written in place or replaced, written through `.data` (no version bump, but the sampled values move), or
    another adapter is set, disabled or rescaled. Taken at step boundaries only (a pause's end, an idle
    engine), never per step."""
    parameters = [part for parameter in model.parameters() for part in quantized_parts(parameter)]
    return (
        *(WeightKey.of(p) for p in parameters),
        value_samples(parameters),
        adapter_keys(model),
    )
