"""Run-scoped patches, counted: the one way the package changes a model for a run. An attribute of a module
(its instance `forward`, `expand_kv`, `layer_idx`, a flag) or of a modeling file (a function in its globals)
set for a run and restored when the last run that uses it ends.

Two runs on one model overlap without nesting (two managers, a warm-up beside a run): each `patched` block
takes its patches or, where one of the same kind is in force on the same owner and name, counts itself a
user of it; the last user to leave puts back what was there before (a module's previous instance attribute,
or none: the class's own shows again). A change that is no attribute of its own (the model's attention
implementation, attention/selection.py) is counted the same way (`switched`: applied by the first run, undone
by the last). Each feature keeps only "which owners, what value": the packed
products (runner/products/packed_model.py), multi-latent attention's pass-through (attention/families/latent.py), the sparse
indexers (attention/families/sparse_index.py), the classic families (attention/families/classic.py), the state layers' split
forwards, the per-request rotary, the native layer ops and the batch-invariant products (runner/).
`restore_all(kind)` undoes one kind, `restore_everything()` every kind (`uninstall()`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from torch import nn

_MISSING = object()
_T = TypeVar("_T")


@dataclass
class Patch:
    """One attribute in force: its owner, the value set and what it replaced, and how many runs use it."""

    owner: object
    name: str
    value: object
    previous: object
    users: int = 1
    undo: Callable[[Any], None] | None = (
        None  # a switch's (`switched`): called with `previous` by the last user
    )


_lock = threading.Lock()
# (kind, id(owner), name) -> the patch in force
_patches: dict[tuple[str, int, str], Patch] = {}


def _key(kind: str, owner: object, name: str) -> tuple[str, int, str]:
    return (kind, id(owner), name)


def in_force(kind: str, owner: object, name: str) -> bool:
    """Whether a `kind` patch of `owner.name` is in force (another run's)."""
    patch = _patches.get(_key(kind, owner, name))
    return patch is not None and patch.owner is owner


def _take(kind: str, owner: object, name: str, make: Callable[[], object]) -> tuple[str, int, str]:
    key = _key(kind, owner, name)
    patch = _patches.get(key)
    if patch is not None and patch.owner is owner:
        patch.users += 1
        return key
    if isinstance(owner, nn.Module):
        previous = owner.__dict__.get(name, _MISSING)
        value = make()
        owner.__dict__[name] = value
    else:
        previous = getattr(owner, name)
        value = make()
        setattr(owner, name, value)
    _patches[key] = Patch(owner, name, value, previous)
    return key


def _release(key: tuple[str, int, str], force: bool = False) -> None:
    patch = _patches.get(key)
    if patch is None:
        return
    patch.users -= 1
    if patch.users > 0 and not force:
        return
    del _patches[key]
    if patch.undo is not None:
        patch.undo(patch.previous)
        return
    owner, name = patch.owner, patch.name
    if isinstance(owner, nn.Module):
        if owner.__dict__.get(name) is patch.value:
            if patch.previous is _MISSING:
                del owner.__dict__[name]
            else:
                owner.__dict__[name] = patch.previous
    elif getattr(owner, name) is patch.value:
        setattr(owner, name, patch.previous)


@contextmanager
def patched(kind: str, patches: Iterable[tuple[object, str, Callable[[], object]]]) -> Iterator[int]:
    """Inside: each (owner, name, make) in force, `make()` called only where no `kind` patch of it is in force
    already (then this block shares it). Yields how many."""
    with _lock:
        keys = [_take(kind, owner, name, make) for owner, name, make in patches]
    try:
        yield len(keys)
    finally:
        with _lock:
            for key in keys:
                _release(key)


@contextmanager
def switched(
    kind: str, owner: object, name: str, apply: Callable[[], _T], undo: Callable[[_T], None]
) -> Iterator[None]:
    """A change that is no attribute of its own (a model's attention implementation), counted like `patched`:
    `apply()` by the first run (it returns what to put back), `undo(that)` by the last to leave; runs entering
    while it is in force share it."""
    with _lock:
        key = _key(kind, owner, name)
        patch = _patches.get(key)
        if patch is not None and patch.owner is owner:
            patch.users += 1
        else:
            _patches[key] = Patch(owner, name, None, apply(), undo=undo)
    try:
        yield
    finally:
        with _lock:
            _release(key)


def restore_all(kind: str) -> None:
    """Every `kind` patch still in force undone (`uninstall()`); a run still going finishes unpatched."""
    with _lock:
        for key in [k for k in _patches if k[0] == kind]:
            _release(key, force=True)


def restore_everything() -> None:
    """Every patch of every kind still in force undone (`uninstall()`)."""
    with _lock:
        for key in list(_patches):
            _release(key, force=True)
