"""Functional tests of `transformers_cb.manager.torch_threads.threads` (no timing assertions: see benchmarks/thread_speed.py)."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest
import torch

from transformers_cb.manager.torch_threads import threads
from transformers_cb.manager.torch_threads.threads import (
    ThreadSettings,
    release_openmp_pool,
    start_worker_thread,
    worker_thread_context,
)

T = TypeVar("T")


def run_in_thread(fn: Callable[[], T]) -> T:
    """Run `fn` in a fresh OS thread and return its result (re-raising its exception)."""
    out: list[Any] = []
    errors: list[BaseException] = []

    def body() -> None:
        try:
            out.append(fn())
        except BaseException as error:  # noqa: BLE001 - re-raised below
            errors.append(error)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return out[0]


def thread_state() -> dict[str, Any]:
    return {
        "num_threads": torch.get_num_threads(),
        "grad": torch.is_grad_enabled(),
        "inference": torch.is_inference_mode_enabled(),
        "flush_denormal": threads._flush_denormal_enabled(),
        "autocast_cpu": torch.is_autocast_enabled("cpu"),
    }


@pytest.fixture(autouse=True)
def restore_torch_state() -> Iterator[None]:
    num_threads = torch.get_num_threads()
    yield
    torch.set_num_threads(num_threads)
    torch.set_flush_denormal(False)


def test_capture_reads_the_calling_thread() -> None:
    settings = ThreadSettings.capture(release_pool=False)
    assert settings.num_threads == torch.get_num_threads()
    assert settings.grad_enabled is True
    assert settings.inference_mode is False
    assert settings.autocast_cpu is False
    with torch.inference_mode():
        inside = ThreadSettings.capture(release_pool=False)
    assert inside.inference_mode is True and inside.grad_enabled is False


def test_settings_are_frozen() -> None:
    settings = ThreadSettings.capture(release_pool=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.num_threads = 3  # type: ignore[misc]


def test_plain_thread_does_not_inherit_modes() -> None:
    """The problem being fixed: grad / inference mode and autocast are thread-local."""
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        state = run_in_thread(thread_state)
    assert state["inference"] is False and state["grad"] is True and state["autocast_cpu"] is False


def test_apply_reproduces_num_threads_one() -> None:
    torch.set_num_threads(1)
    settings = ThreadSettings.capture(release_pool=False)
    assert settings.num_threads == 1

    def worker() -> int:
        settings.apply()
        return torch.get_num_threads()

    assert run_in_thread(worker) == 1


def test_apply_sets_num_threads_that_differ_in_the_worker() -> None:
    settings = dataclasses.replace(ThreadSettings.capture(release_pool=False), num_threads=1)

    def worker() -> tuple[int, int]:
        torch.set_num_threads(2)
        before = torch.get_num_threads()
        settings.apply()
        return before, torch.get_num_threads()

    assert run_in_thread(worker) == (2, 1)


@pytest.mark.parametrize("mode", ["inference", "no_grad", "grad"])
def test_apply_reproduces_grad_and_inference_mode(mode: str) -> None:
    context = {"inference": torch.inference_mode, "no_grad": torch.no_grad, "grad": torch.enable_grad}[mode]
    with context():
        settings = ThreadSettings.capture(release_pool=False)
        expected = thread_state()

    def worker() -> tuple[dict[str, Any], bool]:
        settings.apply()
        tensor = torch.ones(2)
        return thread_state(), tensor.is_inference()

    state, is_inference_tensor = run_in_thread(worker)
    assert state["grad"] == expected["grad"]
    assert state["inference"] == expected["inference"]
    assert is_inference_tensor == (mode == "inference")
    # Nothing leaked into this thread.
    assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()


def test_apply_twice_replaces_the_held_guards() -> None:
    with torch.inference_mode():
        inference = ThreadSettings.capture(release_pool=False)
    grad = ThreadSettings.capture(release_pool=False)

    def worker() -> list[bool]:
        inference.apply()
        first = torch.is_inference_mode_enabled()
        grad.apply()
        second = torch.is_inference_mode_enabled()
        inference.apply()
        return [first, second, torch.is_inference_mode_enabled(), torch.is_grad_enabled()]

    assert run_in_thread(worker) == [True, False, True, False]


def test_apply_reproduces_flush_denormal_set_after_the_thread_started() -> None:
    started, go = threading.Event(), threading.Event()
    result: list[tuple[bool, bool]] = []

    def worker() -> None:
        started.set()
        go.wait()
        before = threads._flush_denormal_enabled()
        settings.apply()
        result.append((before, threads._flush_denormal_enabled()))

    thread = threading.Thread(target=worker)
    thread.start()
    started.wait()
    if not torch.set_flush_denormal(True):
        go.set()
        thread.join()
        pytest.skip("this CPU does not support flushing denormals")
    settings = ThreadSettings.capture(release_pool=False)
    assert settings.flush_denormal is True
    go.set()
    thread.join()
    # The CPU flags are per thread: the worker created before the change did not see it, `apply()` sets it.
    assert result == [(False, True)]


def test_apply_reproduces_cpu_autocast() -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        settings = ThreadSettings.capture(release_pool=False)
    assert settings.autocast_cpu is True and settings.autocast_cpu_dtype == torch.bfloat16

    def worker() -> torch.dtype:
        settings.apply()
        return (torch.ones(4, 4) @ torch.ones(4, 4)).dtype

    assert run_in_thread(worker) == torch.bfloat16


def test_apply_reproduces_affinity() -> None:
    settings = ThreadSettings.capture(release_pool=False)
    if settings.affinity is None:
        pytest.skip("no sched_getaffinity here")

    def worker() -> frozenset[int] | None:
        settings.apply()
        return threads._affinity()

    assert run_in_thread(worker) == settings.affinity


@pytest.mark.parametrize(
    ("captured_inference", "inference_mode", "expected"),
    [(False, True, True), (False, None, False), (True, None, True), (True, False, False)],
)
def test_worker_thread_context_inference_mode(
    captured_inference: bool, inference_mode: bool | None, expected: bool
) -> None:
    with torch.inference_mode(captured_inference):
        settings = ThreadSettings.capture(release_pool=False)

    def worker() -> tuple[bool, bool]:
        with worker_thread_context(settings, inference_mode=inference_mode):
            inside = torch.is_inference_mode_enabled()
        return inside, torch.is_inference_mode_enabled()

    inside, after = run_in_thread(worker)
    assert inside is expected
    assert after is False  # the scoped guard was exited


def test_worker_thread_context_applies_num_threads() -> None:
    torch.set_num_threads(1)
    settings = ThreadSettings.capture(release_pool=False)
    torch.set_num_threads(2)

    def worker() -> int:
        with worker_thread_context(settings):
            return torch.get_num_threads()

    assert run_in_thread(worker) == 1


def test_worker_thread_context_defaults_to_the_current_thread() -> None:
    def worker() -> tuple[bool, bool]:
        with worker_thread_context() as settings:
            return torch.is_inference_mode_enabled(), settings.inference_mode

    assert run_in_thread(worker) == (True, False)


def test_start_worker_thread_runs_target_with_settings() -> None:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}

    def target(a: int, *, b: int) -> None:
        out.update(thread_state(), args=(a, b), name=threading.current_thread().name)

    thread = start_worker_thread(target, 1, b=2, name="cb-test")
    thread.join()
    assert out["args"] == (1, 2) and out["name"] == "cb-test"
    assert out["num_threads"] == 1 and out["inference"] is True
    assert thread.daemon


def test_capture_releases_the_pool_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(threads, "release_openmp_pool", lambda: calls.append(1) or True)
    ThreadSettings.capture(release_pool=False)
    assert calls == []
    ThreadSettings.capture()
    assert calls == [1]


def test_release_openmp_pool_keeps_torch_working() -> None:
    torch.manual_seed(0)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    expected = a @ b
    big = torch.randn(1 << 20)
    assert isinstance(release_openmp_pool(), bool)
    torch.testing.assert_close(a @ b, expected)  # recreates the team
    assert torch.isfinite(big.exp().sum())
    released_in_worker = run_in_thread(lambda: (float((a @ b).sum()), release_openmp_pool()))
    assert released_in_worker[1] == release_openmp_pool()
    torch.testing.assert_close(a @ b, expected)


def test_openmp_runtimes_lists_paths() -> None:
    runtimes = threads.openmp_runtimes()
    assert all(isinstance(path, str) and "gomp" in path for path in runtimes)
    assert release_openmp_pool() is bool(runtimes)
