"""Subprocesses of the tests, bounded by a hang guard and telling what they printed when they do not end.

`subprocess.run(timeout=...)` raises `TimeoutExpired`, whose message names only the command: a hung child's
own output, the one clue to why it hung, would be lost. `run_process` kills the child, then fails with it.
"""

from __future__ import annotations

import subprocess
from typing import Any

from tests.support.timeouts import hang_guard

TAIL = 6000  # characters of a child's output shown in a failure


def _text(data: str | bytes | None) -> str:
    if data is None:
        return ""
    return data.decode(errors="replace") if isinstance(data, bytes) else data


def run_process(command: list[str], timeout: float, **kwargs: Any) -> subprocess.CompletedProcess:
    """`subprocess.run(command, **kwargs)` with its output captured (unless redirected) and the hang guard
    `hang_guard(timeout)`; a child still running then is killed and the test fails with what it printed."""
    if "stdout" not in kwargs and "stderr" not in kwargs:
        kwargs["capture_output"] = True
    limit = hang_guard(timeout)
    try:
        return subprocess.run(command, timeout=limit, **kwargs)
    except subprocess.TimeoutExpired as expired:
        raise AssertionError(
            f"{' '.join(map(str, command))} did not end within {limit:g} s (a hang guard, scaled by "
            f"TRANSFORMERS_CB_TEST_TIMEOUT_SCALE); it printed:\n--- stdout:\n{_text(expired.stdout)[-TAIL:]}"
            f"\n--- stderr:\n{_text(expired.stderr)[-TAIL:]}"
        ) from None
