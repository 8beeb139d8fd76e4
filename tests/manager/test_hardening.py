"""Manager lifecycle regressions: every lifecycle path ends each request exactly once, outputs arrive in
order, streaming works the way transformers' own tests write it, handlers run where asyncio callers
can use them, block-table rows never outlive their request.

Each test failed on the code before the fix. Blocking calls run under `run_with_timeout`, so a hang
fails the test instead of stalling the suite (no assertion depends on timing).
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from transformers import GenerationConfig

from tests.support.faults import FailOnCall
from tests.support.manager import (
    PROMPTS,
    assert_finished_like_generate,
    collect,
    make_model,
    partial_lengths_ok,
)
from tests.support.threads import TIMEOUT, run_with_timeout, wait_for
from transformers_cb import ContinuousBatchingConfig, GenerationOutput, RequestStatus
from transformers_cb.engine.build import build_engine
from transformers_cb.engine.intake.submission import Submission
from transformers_cb.invariants import InvariantError
from transformers_cb.manager.loop import NOT_RUN_ERROR


def slow_forward(manager, seconds: float = 0.01) -> None:
    """Make every step take at least `seconds`, so long requests surely outlast a short grace period."""
    runner = manager.engine.runner
    original = runner._forward

    def forward(step):
        time.sleep(seconds)
        return original(step)

    runner._forward = forward


# -- 2. a manager that never ran still answers ---------------------------------------------------
@pytest.mark.parametrize("how", ["stop", "destroy"])
def test_never_started_manager_ends_its_queue_on_stop_or_destroy(manager, how):
    ids = manager.add_requests(PROMPTS[:3], max_new_tokens=3)
    getattr(manager, how)()
    results = run_with_timeout(lambda: collect(manager, ids))  # get_result without timeout
    for output in results.values():
        assert output.status == RequestStatus.FAILED
        assert output.error == NOT_RUN_ERROR
    assert run_with_timeout(manager.get_result) is None, "nothing outstanding: no wait"
    assert manager.stats().failed == 3


def test_waiting_on_a_manager_that_is_not_running_raises_instead_of_hanging(manager, ref):
    rid = manager.add_request(PROMPTS[0], max_new_tokens=3, streaming=True)
    with pytest.raises(RuntimeError, match="not running"):
        run_with_timeout(manager.get_result)
    with pytest.raises(RuntimeError, match="not running"):
        run_with_timeout(lambda: next(manager.request_id_iter(rid)))
    assert manager.get_result(timeout=0.05) is None, "with a timeout: None, as always"
    manager.start()
    outputs = run_with_timeout(lambda: list(manager.request_id_iter(rid)))
    partial_lengths_ok(outputs)
    assert_finished_like_generate(outputs[-1], ref, PROMPTS[0], 3)
    manager.stop()
    with pytest.raises(KeyError, match=rid):
        manager.request_id_iter(rid)


def test_destroy_is_bounded_and_hard_stops_what_outlasts_the_grace_period(manager):
    manager.start()
    slow_forward(manager)
    rid = manager.add_request(PROMPTS[0], max_new_tokens=400)
    wait_for(lambda: manager.engine.counters.generated_tokens >= 1, what="the request to run")
    run_with_timeout(lambda: manager.destroy(grace_period=0.05))
    assert not manager.is_running() and manager.engine is None
    output = manager.get_result(timeout=TIMEOUT)
    assert output.request_id == rid and output.status == RequestStatus.FAILED
    assert "hard-stopped" in output.error


def test_context_manager_timeout_applies_to_a_non_persistent_manager(model):
    config = ContinuousBatchingConfig(page_size=16, num_blocks=64)

    def run() -> tuple:
        with model.continuous_batching_context_manager(continuous_batching_config=config, timeout=0.05) as m:
            slow_forward(m)
            rid = m.add_request(PROMPTS[0], max_new_tokens=400)
            wait_for(lambda: m.engine.counters.generated_tokens >= 1, what="the request to run")
        return m, rid

    manager, rid = run_with_timeout(run)
    assert manager.engine is None and not manager.is_running()
    output = manager.get_result(timeout=TIMEOUT)
    assert output.request_id == rid and output.status == RequestStatus.FAILED


def test_context_manager_block_false_returns_and_the_thread_finishes_the_queue(model, ref):
    config = ContinuousBatchingConfig(page_size=16, num_blocks=64)
    release = threading.Event()

    def run():
        with model.continuous_batching_context_manager(continuous_batching_config=config, block=False) as m:
            runner = m.engine.runner
            original = runner._forward
            runner._forward = lambda step: (release.wait(TIMEOUT), original(step))[1]
            rid = m.add_request(PROMPTS[0], max_new_tokens=4)
        return m, rid

    manager, rid = run_with_timeout(run)  # returns although the request cannot progress yet
    assert manager.is_running(), "block=False: the exit did not wait"
    release.set()
    assert_finished_like_generate(manager.get_result(rid, timeout=TIMEOUT), ref, PROMPTS[0], 4)
    wait_for(lambda: manager.engine is None and not manager.is_running(), what="the deferred destroy")
    with pytest.raises(RuntimeError, match="destroyed"):
        manager.start()


def test_graceful_stop_from_inside_pause_raises_instead_of_deadlocking(manager):
    manager.start()
    with manager.pause(), pytest.raises(RuntimeError, match="pause"):
        manager.stop()
    assert manager.is_running()


# -- 3. outputs of one request arrive in order, once, one at a time ----------------------------------
def test_slow_handler_registered_mid_stream_gets_ordered_non_concurrent_outputs(manager, ref):
    manager.start()
    others = manager.add_requests(PROMPTS[1:6], max_new_tokens=60)  # a busy manager
    rid = manager.add_request(PROMPTS[0], max_new_tokens=40, streaming=True)
    first = [manager.get_result(rid, timeout=TIMEOUT) for _ in range(5)]  # the stream has begun
    received: list[GenerationOutput] = []
    inside = {"now": 0, "max": 0}
    lock = threading.Lock()

    def slow_handler(output: GenerationOutput) -> None:
        with lock:
            inside["now"] += 1
            inside["max"] = max(inside["max"], inside["now"])
        time.sleep(0.005)
        received.append(output)
        with lock:
            inside["now"] -= 1

    manager.register_result_handler(rid, slow_handler)
    wait_for(lambda: received and received[-1].is_finished(), what="the final output")
    outputs = first + received
    partial_lengths_ok(outputs)
    assert [len(o.generated_tokens) for o in outputs] == list(range(1, 41)), "in order, once"
    assert inside["max"] == 1, "deliveries overlapped"
    assert_finished_like_generate(outputs[-1], ref, PROMPTS[0], 40)
    collect(manager, others)


# -- 4. streaming the way transformers' tests write it ---------------------------------------------
def _chunks_with_a_new_iterator_each(manager, rid: str) -> list[GenerationOutput]:
    chunks = []
    while True:
        chunk = next(manager.request_id_iter(rid))
        chunks.append(chunk)
        if chunk.status == RequestStatus.FINISHED:
            return chunks
        time.sleep(0.005)  # the client handles the chunk; meanwhile the manager produces the next ones


@pytest.mark.parametrize("repeat", range(3))
def test_a_new_iterator_per_chunk_loses_and_repeats_nothing(manager, ref, repeat):
    manager.start()
    ids = [manager.add_request(p, max_new_tokens=12, streaming=True) for p in PROMPTS[:4]]
    streams: dict[str, list[GenerationOutput]] = {}

    def consume(rid: str) -> None:
        streams[rid] = _chunks_with_a_new_iterator_each(manager, rid)

    threads = [threading.Thread(target=consume, args=(rid,), daemon=True) for rid in ids]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT)
        assert not thread.is_alive(), "a chunk loop hangs"
    for rid, prompt in zip(ids, PROMPTS, strict=False):
        assert [len(o.generated_tokens) for o in streams[rid]] == list(range(1, 13)), rid
        partial_lengths_ok(streams[rid])
        assert_finished_like_generate(streams[rid][-1], ref, prompt, 12)
    assert manager.get_result(timeout=0.05) is None


def test_iterator_created_after_the_final_output_raises_key_error(manager):
    manager.start()
    rid = manager.add_request(PROMPTS[0], max_new_tokens=3, streaming=True)
    run_with_timeout(lambda: list(manager.request_id_iter(rid)))
    with pytest.raises(KeyError, match=rid):
        manager.request_id_iter(rid)
    with pytest.raises(ValueError, match=rid):  # also a ValueError, as earlier releases raised
        manager.request_id_iter(rid)


def test_two_live_iterators_share_the_outputs_and_both_end(manager, ref):
    manager.start()
    rid = manager.add_request(PROMPTS[1], max_new_tokens=30, streaming=True)
    got: dict[int, list[GenerationOutput]] = {0: [], 1: []}

    def consume(k: int) -> None:
        got[k].extend(manager.request_id_iter(rid))

    threads = [threading.Thread(target=consume, args=(k,), daemon=True) for k in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT)
        assert not thread.is_alive(), "the iterator that did not get the final output must end too"
    merged = sorted(got[0] + got[1], key=lambda o: (len(o.generated_tokens), o.is_finished()))
    assert [len(o.generated_tokens) for o in merged] == list(range(1, 31)), "each output exactly once"
    for outputs in got.values():
        lengths = [len(o.generated_tokens) for o in outputs]
        assert lengths == sorted(lengths), "each iterator sees its share in order"
    assert_finished_like_generate(merged[-1], ref, PROMPTS[1], 30)


def test_get_result_sees_the_first_token_of_an_unclaimed_stream_before_it_ends(manager):
    """Online benchmarks and simple servers poll get_result(): time to first token must not be e2e."""
    manager.start()
    rid = manager.add_request(PROMPTS[0], max_new_tokens=50, streaming=True)
    first = manager.get_result(timeout=TIMEOUT)
    assert first.request_id == rid and len(first.generated_tokens) == 1 and not first.is_finished()
    outputs = [first]
    while not outputs[-1].is_finished():
        outputs.append(manager.get_result(timeout=TIMEOUT))
    partial_lengths_ok(outputs)


# -- 5. callbacks where the caller can use them ---------------------------------------------------
def test_handler_registered_in_an_event_loop_runs_on_that_loop(manager, ref):
    manager.start()

    async def main() -> tuple[list[int], int, list[GenerationOutput]]:
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        threads: list[int] = []
        outputs: list[GenerationOutput] = []

        def on_output(output: GenerationOutput) -> None:
            threads.append(threading.get_ident())
            outputs.append(output)
            if output.is_finished():
                done.set_result(None)  # only legal on the loop's own thread

        manager.register_result_handler("srv", on_output)  # before add_request, as transformers serve
        manager.add_request(PROMPTS[2], request_id="srv", max_new_tokens=6, streaming=True)
        await asyncio.wait_for(done, TIMEOUT)
        return threads, threading.get_ident(), outputs

    threads, loop_thread, outputs = run_with_timeout(lambda: asyncio.run(main()))
    assert set(threads) == {loop_thread}
    partial_lengths_ok(outputs)
    assert_finished_like_generate(outputs[-1], ref, PROMPTS[2], 6)


def test_handler_registered_outside_a_loop_runs_on_the_manager_thread(manager):
    manager.start()
    rid = manager.add_request(PROMPTS[0], max_new_tokens=3)
    names: list[str] = []
    manager.register_result_handler(rid, lambda output: names.append(threading.current_thread().name))
    wait_for(lambda: names, what="the final output")
    assert names == ["transformers-cb"]


class _Die(BaseException):
    """Escapes every `except Exception`: kills the manager thread."""


def test_background_thread_status_reports_the_fatal_error(manager):
    assert manager.background_thread_status.fatal_error is None
    manager.start()
    assert manager.background_thread_status.fatal_error is None
    error = _Die("injected")

    def dying_step(engine):
        raise error

    manager._loop._step = dying_step
    rid = manager.add_request(PROMPTS[0], max_new_tokens=3)
    output = manager.get_result(rid, timeout=TIMEOUT)
    assert output.status == RequestStatus.FAILED
    wait_for(lambda: not manager.is_running(), what="the thread to die")
    assert manager.background_thread_status.fatal_error is error


# -- 6. block-table rows keyed by request id, freed on every exit ------------------------------------
def test_block_table_rows_never_outlive_their_request():
    model = make_model()
    engine = build_engine(
        model, GenerationConfig(do_sample=False), ContinuousBatchingConfig(page_size=16, num_blocks=32)
    )
    requests = [
        engine.build_request(Submission(p, f"r{i}", max_new_tokens=5)) for i, p in enumerate(PROMPTS[:3])
    ]
    for request in requests:
        engine.add(request)
    engine.step()
    engine.check_integrity()
    (tables,) = engine.packer.block_tables  # one KV group: one table
    assert sorted(tables._rows) == ["r0", "r1", "r2"], "rows are keyed by request id"
    # Every exit gives the row back through one list (`Scheduler.ended`) that the next plan's `released`
    # carries to the runner: the engine's `finish` (fail, cancel), the end in `update()` (r2, below), and a
    # preemption or failure inside `schedule()` (checked after every step by
    # conformance/test_parity_offload.py). Before, a row could stay, and a recycled id() inherited it.
    engine.finish(requests[0], RequestStatus.FAILED, "test")
    engine.finish(requests[1], RequestStatus.CANCELLED)
    engine.check_integrity()  # their rows are pending release, not leaked
    engine.step()
    assert sorted(tables._rows) == ["r2"]
    engine.check_integrity()
    while engine.has_work():
        engine.step()
    engine.check_integrity()
    engine.step()  # an empty plan still releases what ended in the last step
    assert not tables._rows
    engine.check_integrity()
    tables._rows["ghost"], tables._num_written["ghost"] = tables._free_rows.pop(), 0
    with pytest.raises(InvariantError, match="ghost"):
        engine.check_integrity()


# -- 8. throughput counts delivered tokens only ------------------------------------------------------
def test_throughput_counts_only_delivered_tokens(manager):
    manager.start()
    finished = manager.add_request(PROMPTS[0], max_new_tokens=5)
    streamed = manager.add_request(PROMPTS[1], max_new_tokens=4, streaming=True)
    collect_all = [manager.get_result(finished, timeout=TIMEOUT)]
    collect_all += [manager.get_result(streamed, timeout=TIMEOUT) for _ in range(4)]
    assert collect_all[-1].is_finished()
    assert manager.stats().delivered_tokens == 9

    cancelled = manager.add_request(PROMPTS[2], max_new_tokens=400)  # never delivered a token
    wait_for(lambda: manager.engine.counters.generated_tokens >= 9 + 3, what="the long request to run")
    manager.cancel_request(cancelled)
    output = manager.get_result(cancelled, timeout=TIMEOUT)
    assert output.status == RequestStatus.CANCELLED and output.generated_tokens

    runner = manager.engine.runner
    runner._forward = FailOnCall(runner._forward, RuntimeError("injected"), at=2)
    failed = manager.add_request(PROMPTS[3], max_new_tokens=5)
    output = manager.get_result(failed, timeout=TIMEOUT)
    assert output.status == RequestStatus.FAILED and len(output.generated_tokens) == 1
    stats = manager.stats()
    assert stats.delivered_tokens == 9, (
        "tokens of cancelled / failed non-streaming requests are not delivered"
    )
    assert stats.tokens_per_second >= 0.0  # a 10 s window: on a slow machine it may have emptied already
