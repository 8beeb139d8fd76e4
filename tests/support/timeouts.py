"""The one place test timeouts come from: hang guards, never speed checks.

Every wait in the suite (a manager result, a server's first line, a subprocess, a thread join) takes
its limit from `hang_guard(seconds)`: generous on a quiet machine, and multiplied by
`TRANSFORMERS_CB_TEST_TIMEOUT_SCALE` (default 1) on a machine that is slower or busier than that.
A timeout here means "stuck", so tests never assert durations or throughput (benchmarks measure them).
"""

from __future__ import annotations

import os

SCALE_ENV = "TRANSFORMERS_CB_TEST_TIMEOUT_SCALE"


def timeout_scale() -> float:
    """The factor every hang guard is multiplied by (`TRANSFORMERS_CB_TEST_TIMEOUT_SCALE`, default 1)."""
    raw = os.environ.get(SCALE_ENV, "1")
    try:
        scale = float(raw)
    except ValueError as error:
        raise ValueError(f"{SCALE_ENV}={raw!r} is not a number") from error
    if scale <= 0:
        raise ValueError(f"{SCALE_ENV}={raw!r} must be > 0")
    return scale


def hang_guard(seconds: float) -> float:
    """`seconds` (a limit that a healthy run on a quiet machine stays far below), scaled."""
    return seconds * timeout_scale()
