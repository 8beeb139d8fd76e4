"""`check()`: internal invariants that hold under `python -O` too.

NOTE: `assert` statements vanish under `python -O`, and with them any work done
inside them (an allocation inside an `assert` leaves a request without pages).
The package therefore never uses `assert`; a broken invariant raises
`InvariantError`, an `AssertionError`, so tests and callers that expect one keep working.
"""

from __future__ import annotations

from typing import TypeVar

_T = TypeVar("_T")


class InvariantError(AssertionError):
    """An internal invariant of the engine does not hold (a bug in transformers_cb)."""


def check(condition: bool, message: str = "") -> None:
    """Raise `InvariantError(message)` unless `condition` holds. Evaluate nothing costly in `message`'s caller
    on the hot path: build it with an f-string only where the check is rare."""
    if not condition:
        raise InvariantError(message)


def present(value: _T | None, message: str = "") -> _T:
    """`value`, known not to be None here (the type checker narrows it); `InvariantError(message)` if it is."""
    if value is None:
        raise InvariantError(message)
    return value
