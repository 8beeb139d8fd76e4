"""Serving PEFT adapters by name (docs/adapters.md): `--adapter name=path` (repeatable) loads each into the
served model at start (transformers' `load_adapter`), `POST /v1/adapters` loads one more while serving;
the request's `model` field picks the adapter, vLLM's convention: the base model's id runs the base model
(no adapter at all), an adapter's name runs that adapter, anything else is a 404 with an OpenAI-style body.
`/v1/models` lists the base model, then each adapter (its `parent`: the base model's id). `--max-adapters N`
keeps at most N resident in the model, least recently used unloaded first, never one in use."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .protocol import ApiError

if TYPE_CHECKING:
    from ..manager.manager import ContinuousBatchingManager


def parse_adapter_flag(value: str) -> tuple[str, str]:
    """`name=path` as (name, path); `ValueError` naming the flag's value otherwise."""
    name, sep, path = value.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise ValueError(f"--adapter {value!r}: expected name=path (a PEFT adapter folder)")
    return name.strip(), path.strip()


@dataclass
class ServedAdapters:
    """The adapters a server serves (name -> where it was loaded from) beside its base model's id, and which
    of them are resident in the model (`resident`, least recently used first). With `max_resident`, a request
    for an adapter that is not resident loads it again, unloading the least recently used one that no live
    request uses and no request being submitted holds (`held`); all in use: a 503."""

    base_name: str
    paths: dict[str, str] = field(default_factory=dict)
    max_resident: int | None = None
    resident: OrderedDict[str, None] = field(default_factory=OrderedDict)
    _holds: Counter[str] = field(default_factory=Counter, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if self.max_resident is not None and self.max_resident < 1:
            raise ValueError(f"--max-adapters must be at least 1, got {self.max_resident}")
        for name in self.paths:
            self.resident.setdefault(name, None)

    def adapter_of(self, model: str) -> str | None:
        """The adapter a request's `model` field asks for (None: the base model); 404 when unknown."""
        if model == self.base_name:
            return None
        if model in self.paths:
            return model
        known = [self.base_name, *sorted(self.paths)]
        raise ApiError(
            404,
            f"The model `{model}` does not exist; this server serves {known}",
            param="model",
            code="model_not_found",
        )

    def cards(self, created: int) -> list[dict[str, object]]:
        """`/v1/models`' entries: the base model, then each adapter (vLLM's LoRA cards: `parent`, `root`)."""
        base = {"id": self.base_name, "object": "model", "created": created, "owned_by": "transformers-cb"}
        adapters = [
            {**base, "id": name, "parent": self.base_name, "root": path}
            for name, path in sorted(self.paths.items())
        ]
        return [base, *adapters]

    def load(
        self, model: Any, name: str, path: str, manager: ContinuousBatchingManager | None = None
    ) -> None:
        """Serve the adapter at `path` as `name`: loaded into `model` now (through `manager` while serving: a
        pause), or only registered when `max_resident` adapters are resident already (loaded at its first
        request). `ValueError` naming the problem."""
        if not name or name == self.base_name:
            raise ValueError(f"adapter name {name!r} is empty or the base model's id")
        with self._lock:
            if name in self.paths:
                raise ValueError(f"adapter {name!r} is already loaded (from {self.paths[name]})")
            if self.max_resident is None or len(self.resident) < self.max_resident:
                if manager is not None:
                    manager.adapters.load(name, path)
                else:
                    load_into(model, name, path)
                self.resident[name] = None
            self.paths[name] = path

    @asynccontextmanager
    async def held(self, name: str | None, manager: ContinuousBatchingManager) -> AsyncIterator[None]:
        """Inside: adapter `name` resident and never unloaded (a request on it is being submitted)."""
        if name is None:
            yield
            return
        await asyncio.to_thread(self._hold, name, manager)
        try:
            yield
        finally:
            with self._lock:
                self._holds[name] -= 1

    def _hold(self, name: str, manager: ContinuousBatchingManager) -> None:
        with self._lock:
            if name in self.resident:
                self.resident.move_to_end(name)
                self._holds[name] += 1
                return
            in_use = manager.adapters.in_use()
            while self.max_resident is not None and len(self.resident) >= self.max_resident:
                victims = [v for v in self.resident if not self._holds[v] and not in_use.get(v)]
                if not victims:
                    raise ApiError(
                        503,
                        f"all {self.max_resident} resident adapters are in use (--max-adapters); retry later",
                    )
                try:
                    manager.adapters.unload(victims[0])
                except ValueError:  # a request on it arrived in between: in use after all
                    in_use[victims[0]] = 1
                    continue
                del self.resident[victims[0]]
            try:
                manager.adapters.load(name, self.paths[name])
            except ValueError as error:
                raise ApiError(500, f"cannot load adapter {name!r} again: {error}", param="model") from error
            self.resident[name] = None
            self._holds[name] += 1


def load_into(model: Any, name: str, path: str) -> None:
    """transformers' `load_adapter`; its errors (no such folder, not an adapter, PEFT missing) as
    `ValueError` naming the adapter."""
    try:
        model.load_adapter(path, adapter_name=name)
    except (OSError, ValueError, ImportError, KeyError, RuntimeError) as error:
        raise ValueError(f"cannot load adapter {name!r} from {path!r}: {error}") from error
