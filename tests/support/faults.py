"""Fault injection: a stand-in for a method that raises on one chosen call and otherwise calls through."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class FailOnCall:
    """Calls `fn`, except the `at`-th call (1-based; None: none yet), which raises `error` instead.

    `calls` counts the calls, so a test can aim at a later one: `wrapper.at = wrapper.calls + 2`."""

    def __init__(self, fn: Callable[..., Any], error: BaseException, at: int | None = None) -> None:
        self.fn, self.error, self.at = fn, error, at
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls == self.at:
            raise self.error
        return self.fn(*args, **kwargs)
