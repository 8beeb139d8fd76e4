"""A running manager's adapters (`manager.adapters`, docs/adapters.md): which its requests use, and loading,
updating in place and unloading one while requests run. Each change happens inside a `pause()` of the
manager (between two steps), so it is a weight change the loop sees at the pause's exit (a new weight
version: no page computed before is hit again; the requests in flight treated by `mode`). An update also
bumps the adapter's own version (`AdapterRegistry.bump`), which salts its later requests' page keys. An
adapter a live request uses is never unloaded."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from ..engine.weights.adapter_registry import AdapterRegistry
from .state import ManagerState

Pause = Callable[..., AbstractContextManager[None]]  # `ContinuousBatchingManager.pause`

PEFT_PREFIX = "base_model.model."  # the keys of a state dict PEFT saves (get_peft_model_state_dict)


class ManagerAdapters:
    """The adapter lifecycle of one manager (its model's PEFT adapters): the manager's `model`, its shared
    `state` (the live requests, the engine) and its `pause`."""

    def __init__(self, model: nn.Module, state: ManagerState, pause: Pause) -> None:
        self._model = model
        self._state = state
        self._pause = pause

    def _registry(self) -> AdapterRegistry:
        engine = self._state.engine
        registry = engine.adapters if engine is not None else None
        return registry if registry is not None else AdapterRegistry(self._model)

    def names(self) -> list[str]:
        """Every adapter the model carries."""
        return sorted(self._registry().adapters())

    def in_use(self) -> dict[str, int]:
        """Adapter name -> how many live requests (queued or running) run on it."""
        with self._state.lock:
            return self.in_use_locked()

    def load(self, name: str, source: Any, mode: str = "keep") -> None:
        """Load an adapter as `name`: a PEFT adapter folder or hub id (transformers' `load_adapter`), or a
        `peft.PeftConfig` (a fresh adapter, `add_adapter`). `ValueError` if the name is taken."""
        if name in self._registry().adapters():
            raise ValueError(f"adapter {name!r} is already loaded; update it with manager.adapters.update")
        model: Any = self._model
        with self._pause(mode):
            if isinstance(source, (str, bytes)) or hasattr(source, "__fspath__"):
                model.load_adapter(str(source), adapter_name=name)
            else:
                model.add_adapter(source, adapter_name=name)
        self._registry().refresh()

    def update(self, name: str, weights: Mapping[str, torch.Tensor], mode: str = "keep") -> int:
        """Write new values into adapter `name`'s parameters in place (an RL policy's LoRA synced from the
        trainer): `weights` keyed as the model names its parameters (`...q_proj.lora_A.<name>.weight`) or as
        PEFT saves them (`base_model.model....q_proj.lora_A.weight`). All or nothing: an unknown key or a
        wrong shape is a `ValueError` before anything is written. Returns the adapter's new version."""
        registry = self._registry()
        if name not in registry.adapters():
            raise ValueError(f"unknown adapter {name!r}; the model's adapters: {sorted(registry.adapters())}")
        targets = adapter_parameters(self._model, name)
        writes = []
        for key, value in weights.items():
            parameter = targets.get(key.removeprefix(PEFT_PREFIX))
            if parameter is None:
                raise ValueError(f"update of adapter {name!r}: {key!r} is none of its parameters")
            if tuple(value.shape) != tuple(parameter.shape):
                raise ValueError(
                    f"update of adapter {name!r}: {key!r} has shape {tuple(value.shape)}, "
                    f"the parameter {tuple(parameter.shape)}"
                )
            writes.append((parameter, value))
        with self._pause(mode), torch.no_grad():
            for parameter, value in writes:
                parameter.copy_(value)
            version = registry.bump(name)
        return version

    def unload(self, name: str) -> None:
        """Delete adapter `name` from the model. `ValueError` if it is unknown or a live request uses it."""
        registry = self._registry()
        if name not in registry.adapters():
            raise ValueError(f"unknown adapter {name!r}; the model's adapters: {sorted(registry.adapters())}")
        with self._pause(), self._state.lock:  # no submission in between: it would resolve the name
            users = self.in_use_locked().get(name, 0)
            if users:
                raise ValueError(f"adapter {name!r} is in use by {users} live request(s): not unloaded")
            delete_adapter(self._model, name)
            registry.refresh()

    def in_use_locked(self) -> dict[str, int]:
        """`in_use` with the manager's lock already held."""
        requests = list(self._state.live.values())
        return dict(Counter(name for r in requests if r.adapter is not None for name in r.adapter.names))


def adapter_parameters(model: nn.Module, name: str) -> dict[str, torch.Tensor]:
    """Adapter `name`'s parameters, each under both its model name and PEFT's saved name (no adapter)."""
    found: dict[str, torch.Tensor] = {}
    marker = f".{name}."
    for full, parameter in model.named_parameters():
        if marker not in f".{full}":
            continue
        found[full] = parameter
        found[f".{full}".replace(marker, ".", 1).lstrip(".")] = parameter
    return found


def delete_adapter(model: nn.Module, name: str) -> None:
    """Every PEFT layer forgets adapter `name` (PEFT's own `delete_adapter` per layer), and the model's
    `peft_config` (transformers' integration) too."""
    for module in model.modules():
        delete = getattr(module, "delete_adapter", None)
        if "_active_adapter" in module.__dict__ and callable(delete):
            delete(name)
    configs = getattr(model, "peft_config", None)
    if isinstance(configs, dict):
        configs.pop(name, None)
