"""The suite's own hang guards: one scale for every timeout, and a hung child that tells what it printed."""

from __future__ import annotations

import sys

import pytest

from tests.support.processes import run_process
from tests.support.timeouts import SCALE_ENV, hang_guard, timeout_scale


def test_hang_guards_scale_with_one_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SCALE_ENV, raising=False)
    assert timeout_scale() == 1.0 and hang_guard(30) == 30
    monkeypatch.setenv(SCALE_ENV, "2.5")
    assert hang_guard(30) == 75


@pytest.mark.parametrize("raw", ["fast", "0", "-1"])
def test_a_bad_scale_is_refused_by_name(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv(SCALE_ENV, raw)
    with pytest.raises(ValueError, match=SCALE_ENV):
        timeout_scale()


def test_a_hung_child_fails_with_its_own_output(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SCALE_ENV, "1")
    script = "import sys, time; print('started the work', flush=True); print('to stderr', file=sys.stderr, flush=True); time.sleep(600)"
    with pytest.raises(AssertionError) as failure:
        run_process([sys.executable, "-c", script], timeout=3, text=True)
    message = str(failure.value)
    assert "did not end within 3 s" in message and SCALE_ENV in message
    assert "started the work" in message and "to stderr" in message


def test_a_child_that_ends_returns_its_completed_process() -> None:
    done = run_process([sys.executable, "-c", "print('ok')"], timeout=60, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "ok"
