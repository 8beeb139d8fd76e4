"""Bounded waits for the tests of threaded code: a bug fails the test instead of hanging it.

`TIMEOUT` is generous (`tests/support/timeouts.py` scales it): a hang becomes a failure, a slow shared
CPU does not (no timing assertion)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from tests.support.timeouts import hang_guard

TIMEOUT = hang_guard(120.0)


def call_in_thread(
    fn: Callable[[], Any], timeout: float = TIMEOUT, what: str | None = None
) -> tuple[Any, BaseException | None]:
    """Run `fn` in a helper thread: (its value, None) or (None, what it raised). Fails if it has not
    returned within `timeout`."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as error:  # noqa: BLE001 - handed to the test thread
            box["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"{what or getattr(fn, '__name__', fn)} did not return within {timeout}s"
    return box.get("value"), box.get("error")


def run_with_timeout(fn: Callable[[], Any], timeout: float = TIMEOUT, what: str | None = None) -> Any:
    """Run `fn` in a helper thread; fail (instead of hanging) if it does not return in time; re-raise
    what it raised in the test thread."""
    value, error = call_in_thread(fn, timeout, what)
    if error is not None:
        raise error
    return value


def wait_for(predicate: Callable[[], bool], timeout: float = TIMEOUT, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)
