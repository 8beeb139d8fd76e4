"""ContinuousBatchingManager fault isolation: a forward or scheduler failure fails only the requests it
concerns, a dead manager thread unblocks every waiter, submissions racing `stop()` are served or refused."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from typing import Any

import pytest

from tests.support.faults import FailOnCall
from tests.support.manager import (
    MANAGER_LOGGER,
    PROMPTS,
    assert_finished_like_generate,
    assert_no_leak,
    collect,
)
from tests.support.threads import TIMEOUT, run_with_timeout, wait_for
from transformers_cb import (
    GenerationOutput,
    ManagerDeadError,
    RequestStatus,
)


def test_forward_failure_fails_only_the_requests_of_that_step(manager, ref):
    manager.start()
    runner = manager.engine.runner
    runner._forward = flaky_forward = FailOnCall(runner._forward, RuntimeError("injected kernel error"))
    before = manager.add_request(PROMPTS[0], max_new_tokens=3)
    assert_finished_like_generate(manager.get_result(before, timeout=TIMEOUT), ref, PROMPTS[0], 3)
    with manager.pause():
        doomed = manager.add_requests(PROMPTS[1:3], max_new_tokens=4)
        flaky_forward.at = flaky_forward.calls + 2  # their second step (first decode) raises
    results = collect(manager, doomed)
    for output in results.values():
        assert output.status == RequestStatus.FAILED
        assert "RuntimeError" in output.error and "injected kernel error" in output.error
        assert len(output.generated_tokens) == 1
    assert manager.engine.counters.failed_steps == 1
    assert manager.is_running()
    after = manager.add_requests(PROMPTS[3:5], max_new_tokens=4)
    results = collect(manager, after)
    for rid, prompt in zip(after, PROMPTS[3:5], strict=True):
        assert_finished_like_generate(results[rid], ref, prompt, 4)
    assert_no_leak(manager)


def test_scheduler_error_fails_the_running_requests_only(manager, ref):
    manager.start()
    scheduler = manager.engine.scheduler
    original = scheduler.schedule
    fail_next = threading.Event()

    def flaky_schedule(*args, **kwargs):
        if fail_next.is_set():
            fail_next.clear()
            raise ValueError("injected scheduler bug")
        return original(*args, **kwargs)

    scheduler.schedule = flaky_schedule
    victim = manager.add_request(PROMPTS[0], max_new_tokens=400)
    wait_for(lambda: manager.engine.counters.generated_tokens >= 2, what="the request to run")
    with manager.pause():
        fail_next.set()
    output = manager.get_result(victim, timeout=TIMEOUT)
    assert output.status == RequestStatus.FAILED
    assert "ValueError" in output.error and "injected scheduler bug" in output.error
    assert manager.is_running()
    rid = manager.add_request(PROMPTS[1], max_new_tokens=4)
    assert_finished_like_generate(manager.get_result(rid, timeout=TIMEOUT), ref, PROMPTS[1], 4)
    assert_no_leak(manager)


class _Die(BaseException):
    """Escapes every `except Exception`: kills the manager thread."""


def test_thread_death_unblocks_every_waiter(manager, caplog):
    caplog.set_level(logging.ERROR, logger=MANAGER_LOGGER)
    manager._loop._step = FailOnCall(manager._loop._step, _Die("injected thread death"), at=3)
    manager.start()
    with manager.pause():
        plain = manager.add_requests(PROMPTS[:3], max_new_tokens=400)
        streamed = manager.add_request(PROMPTS[3], max_new_tokens=400, streaming=True)
        handled = manager.add_request(PROMPTS[4], max_new_tokens=400)
        awaited = manager.add_request(PROMPTS[5], max_new_tokens=400, streaming=True)
        handler_outputs: list[GenerationOutput] = []
        manager.register_result_handler(handled, handler_outputs.append)

        shared: list[GenerationOutput] = []
        outcomes: dict[str, Any] = {}

        def reader() -> None:
            try:
                while True:
                    output = manager.get_result()  # no timeout: must not hang once the thread died
                    if output is not None:
                        shared.append(output)
            except ManagerDeadError as error:
                outcomes["reader"] = error

        def streamer() -> None:
            outputs = []
            try:
                for output in manager.request_id_iter(streamed):
                    outputs.append(output)
            except ManagerDeadError as error:
                outcomes["stream_error"] = error
            outcomes["stream"] = outputs

        def async_consumer() -> None:
            async def consume():
                return [output async for output in manager.stream(awaited)]

            try:
                outcomes["async"] = asyncio.run(consume())
            except ManagerDeadError as error:
                outcomes["async_error"] = error
                outcomes["async"] = []

        threads = [threading.Thread(target=t, daemon=True) for t in (reader, streamer, async_consumer)]
        for thread in threads:
            thread.start()
        # (private) wait until both streams are claimed, so their outputs cannot reach the shared queue
        routes = manager._router._routes
        wait_for(lambda: all(routes[r].iterated for r in (streamed, awaited)), what="claims")
    for thread in threads:
        thread.join(TIMEOUT)
        assert not thread.is_alive(), "a waiter hangs after the manager thread died"
    assert "manager thread died" in caplog.text
    wait_for(lambda: not manager.is_running(), what="the thread to end")
    assert isinstance(outcomes["reader"], ManagerDeadError)
    assert isinstance(outcomes["reader"], RuntimeError)

    finals = Counter(o.request_id for o in shared if o.is_finished())
    finals.update(o.request_id for o in outcomes["stream"] if o.is_finished())
    finals.update(o.request_id for o in outcomes["async"] if o.is_finished())
    finals.update(o.request_id for o in handler_outputs if o.is_finished())
    assert finals == Counter([*plain, streamed, handled, awaited]), "exactly one final per request"
    for output in [*shared, *handler_outputs]:
        assert output.status == RequestStatus.FAILED
        assert "_Die" in output.error and "injected thread death" in output.error

    # Fresh calls fail fast instead of waiting forever.
    with pytest.raises(ManagerDeadError):
        run_with_timeout(lambda: manager.get_result())
    with pytest.raises(ManagerDeadError):
        run_with_timeout(lambda: list(manager))
    # Later submissions are refused (not queued for a thread that will never serve them) ...
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=MANAGER_LOGGER):
        assert manager.add_request(PROMPTS[0], max_new_tokens=3) is None
    assert "refused" in caplog.text
    # ... and a dead manager cannot be restarted (its router would keep raising ManagerDeadError).
    with pytest.raises(ManagerDeadError):
        manager.start()
    assert not manager.is_running()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_waiters_wake_even_if_failing_the_requests_raises(manager):
    def broken_fail_everything(message: str) -> None:
        raise RuntimeError("bookkeeping bug while failing the requests")

    def dying_step(engine):
        raise _Die("injected thread death")

    manager._loop.fail_everything = broken_fail_everything
    manager._loop._step = dying_step
    try:
        manager.start()
        manager.add_request(PROMPTS[0], max_new_tokens=3)
        with pytest.raises(ManagerDeadError):
            run_with_timeout(lambda: manager.get_result())
        wait_for(lambda: not manager.is_running(), what="the thread to end")
    finally:
        del manager._loop.fail_everything  # back to the real one for the fixture's teardown


@pytest.mark.parametrize("hard_stop", [False, True], ids=["graceful", "hard"])
def test_submissions_racing_stop_are_served_or_refused(manager, ref, hard_stop):
    manager.start()
    accepted: list[tuple[str, list[int]]] = []
    refused = []
    lock = threading.Lock()
    go = threading.Event()

    def submitter(k: int) -> None:
        go.wait()
        for i in range(12):
            prompt = PROMPTS[(k + i) % len(PROMPTS)]
            rid = manager.add_request(prompt, max_new_tokens=2)
            with lock:
                if rid is None:
                    refused.append(i)
                else:
                    accepted.append((rid, prompt))
            time.sleep(0.001)

    threads = [threading.Thread(target=submitter, args=(k,), daemon=True) for k in range(4)]
    for thread in threads:
        thread.start()
    go.set()
    time.sleep(0.02)
    manager.stop(hard_stop=hard_stop, timeout=TIMEOUT)
    for thread in threads:
        thread.join(TIMEOUT)
        assert not thread.is_alive()
    assert not manager.is_running()
    assert len(accepted) + len(refused) == 48

    results = collect(manager, [rid for rid, _ in accepted])
    assert manager.get_result(timeout=0.1) is None, "no extra results"
    for rid, prompt in accepted:
        output = results[rid]
        if hard_stop and output.status == RequestStatus.FAILED:
            assert "RuntimeError" in output.error
        else:
            assert_finished_like_generate(output, ref, prompt, 2)
    manager.engine.check_integrity()
    assert manager.engine.num_used_pages == 0
