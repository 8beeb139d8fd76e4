"""Serving PEFT adapters by name (docs/adapters.md): `--adapter name=path` (repeatable) loads each into the
served model at start (transformers' `load_adapter`), `POST /v1/adapters` loads one more while serving;
the request's `model` field picks the adapter, vLLM's convention: the base model's id runs the base model
(no adapter at all), an adapter's name runs that adapter, anything else is a 404 with an OpenAI-style body.
`/v1/models` lists the base model, then each adapter (its `parent`: the base model's id)."""

from __future__ import annotations

import threading
from contextlib import nullcontext
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
    """The adapters a server serves (name -> where it was loaded from) beside its base model's id."""

    base_name: str
    paths: dict[str, str] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

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

    def cards(self, created: int) -> list[dict[str, Any]]:
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
        """Load the adapter at `path` as `name` into `model` (inside a pause of `manager` when serving: a new
        weight version, the requests in flight kept). `ValueError` naming the problem."""
        if not name or name == self.base_name:
            raise ValueError(f"adapter name {name!r} is empty or the base model's id")
        with self._lock:
            if name in self.paths:
                raise ValueError(f"adapter {name!r} is already loaded (from {self.paths[name]})")
            with manager.pause() if manager is not None else nullcontext():
                load_into(model, name, path)
            self.paths[name] = path


def load_into(model: Any, name: str, path: str) -> None:
    """transformers' `load_adapter`; its errors (no such folder, not an adapter, PEFT missing) as
    `ValueError` naming the adapter."""
    try:
        model.load_adapter(path, adapter_name=name)
    except (OSError, ValueError, ImportError, KeyError, RuntimeError) as error:
        raise ValueError(f"cannot load adapter {name!r} from {path!r}: {error}") from error
