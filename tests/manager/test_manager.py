"""ContinuousBatchingManager: lifecycle, submissions, result routing, streaming, callbacks, asyncio,
cancellation, stop / hard stop / destroy, pause, stats, fault isolation and thread safety.

Every finished greedy output is compared with plain `model.generate()` on the prompt alone, run on a
separate model instance with the same weights (the manager's model is switched to paged attention
while its thread runs). Every blocking call has a timeout so a bug fails a test instead of hanging it.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.support.models import tiny_llama
from tests.support.prompts import prompts_of_lengths
from tests.support.reference import greedy_reference
from transformers_cb import (
    ContinuousBatchingConfig,
    ContinuousBatchingManager,
    GenerationOutput,
    ManagerDeadError,
    ManagerStats,
    RequestStatus,
)
from transformers_cb.api.model_methods import CACHED_MANAGER_ATTR

CB_CONFIG = {"page_size": 16, "num_blocks": 64}
TIMEOUT = 30.0  # generous: a hang becomes a failure, a slow shared CPU does not
MANAGER_LOGGER = "transformers_cb.manager.manager"
PROMPTS = prompts_of_lengths([4, 7, 11, 5, 9, 13, 6, 8], seed=1)


def make_model(seed: int = 0):
    model = tiny_llama(seed=seed)
    model.generation_config.eos_token_id = None
    return model


class References:
    """Greedy `generate()` tokens per prompt, cached; shorter lengths are prefixes of longer runs (no eos)."""

    def __init__(self, model) -> None:
        self.model = model
        self._cache: dict[tuple[int, ...], list[int]] = {}

    def __call__(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        key = tuple(prompt)
        cached = self._cache.get(key, [])
        if len(cached) < max_new_tokens:
            cached = greedy_reference(self.model, list(prompt), max(max_new_tokens, 8))
            self._cache[key] = cached
        return cached[:max_new_tokens]


def new_manager(model, **config: Any) -> ContinuousBatchingManager:
    return model.init_continuous_batching(
        continuous_batching_config=ContinuousBatchingConfig(**{**CB_CONFIG, **config})
    )


# -- helpers ----------------------------------------------------------------------------------
def run_with_timeout(fn: Callable[[], Any], timeout: float = TIMEOUT) -> Any:
    """Run `fn` in a helper thread; fail (instead of hanging) if it does not return in time."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as error:  # noqa: BLE001 - re-raised in the test thread
            box["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"{getattr(fn, '__name__', fn)} did not return within {timeout}s"
    if "error" in box:
        raise box["error"]
    return box.get("value")


def wait_for(predicate: Callable[[], bool], timeout: float = TIMEOUT, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


def collect(manager: ContinuousBatchingManager, ids, timeout: float = TIMEOUT) -> dict[str, GenerationOutput]:
    """The final results of `ids` from `get_result()`; each exactly once."""
    wanted, results = set(ids), {}
    deadline = time.monotonic() + timeout
    while wanted - results.keys():
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"no final result for {sorted(wanted - results.keys())}"
        output = manager.get_result(timeout=remaining)
        if output is None:
            continue
        assert output.is_finished(), output
        assert output.request_id not in results, f"second final result for {output.request_id}"
        results[output.request_id] = output
    assert results.keys() == wanted, f"unexpected results {sorted(results.keys() - wanted)}"
    return results


def assert_finished_like_generate(output: GenerationOutput, ref: References, prompt, max_new_tokens) -> None:
    assert output.status == RequestStatus.FINISHED, (output.status, output.error)
    assert output.error is None
    assert output.prompt_ids == list(prompt)
    assert output.generated_tokens == ref(prompt, max_new_tokens)


def assert_no_leak(manager: ContinuousBatchingManager) -> None:
    """Integrity of the pages; all of them free when no request is live. Holds the loop while checking."""
    with manager.pause():
        engine = manager.engine
        engine.check_integrity()
        if not engine.has_work():
            assert engine.cache.pool.num_free_pages == engine.cache.pool.num_pages


def partial_lengths_ok(outputs: list[GenerationOutput]) -> None:
    """Streaming outputs: partials grow by exactly one token, each a prefix of the final."""
    *partials, final = outputs
    assert final.is_finished()
    assert all(not p.is_finished() for p in partials)
    lengths = [len(o.generated_tokens) for o in partials]
    assert lengths == list(range(1, len(partials) + 1)), lengths
    for partial in partials:
        assert final.generated_tokens[: len(partial.generated_tokens)] == partial.generated_tokens


# -- lifecycle --------------------------------------------------------------------------------
def test_init_returns_a_manager_that_is_not_started(manager):
    assert isinstance(manager, ContinuousBatchingManager)
    assert not manager.is_running()
    manager.start()
    assert manager.is_running()
    manager.start()  # a second start is a harmless no-op
    assert manager.is_running()
    manager.stop()
    assert not manager.is_running()


def test_context_manager_starts_stops_and_destroys(model, ref):
    config = ContinuousBatchingConfig(**CB_CONFIG)
    with model.continuous_batching_context_manager(continuous_batching_config=config) as manager:
        assert manager.is_running()
        rid = manager.add_request(PROMPTS[0], max_new_tokens=5)
        assert_finished_like_generate(manager.get_result(timeout=TIMEOUT), ref, PROMPTS[0], 5)
        assert rid is not None
    assert not manager.is_running()
    assert manager.engine is None
    assert getattr(model, CACHED_MANAGER_ATTR, None) is None
    with pytest.raises(RuntimeError, match="destroyed"):
        manager.start()
    assert model.config._attn_implementation == "sdpa", "the user's attention backend is restored"


def test_context_manager_stops_gracefully_on_normal_exit(model, ref):
    config = ContinuousBatchingConfig(**CB_CONFIG)
    with model.continuous_batching_context_manager(continuous_batching_config=config) as manager:
        ids = [manager.add_request(p, max_new_tokens=4) for p in PROMPTS[:3]]
    # The queued requests completed before the context returned; their results are still readable.
    results = collect(manager, ids, timeout=1)
    for rid, prompt in zip(ids, PROMPTS[:3], strict=True):
        assert_finished_like_generate(results[rid], ref, prompt, 4)


def test_context_manager_hard_stops_when_the_block_raises(model):
    config = ContinuousBatchingConfig(**CB_CONFIG)
    with (
        pytest.raises(ZeroDivisionError),
        model.continuous_batching_context_manager(continuous_batching_config=config) as manager,
    ):
        rid = manager.add_request(PROMPTS[0], max_new_tokens=400)
        1 / 0  # noqa: B018
    output = manager.get_result(timeout=TIMEOUT)
    assert output.request_id == rid
    assert output.status == RequestStatus.FAILED
    assert "RuntimeError" in output.error
    assert manager.engine is None


def test_persistent_manager_is_cached_and_reused(model, ref):
    config = ContinuousBatchingConfig(**CB_CONFIG)
    with model.continuous_batching_context_manager(
        continuous_batching_config=config, persistent_manager=True
    ) as first:
        manager_id = first.add_request(PROMPTS[0], max_new_tokens=3)
        assert_finished_like_generate(first.get_result(timeout=TIMEOUT), ref, PROMPTS[0], 3)
    assert not first.is_running()
    assert first.engine is not None, "a persistent manager is stopped, not destroyed"
    assert getattr(model, CACHED_MANAGER_ATTR) is first

    with model.continuous_batching_context_manager(persistent_manager=True) as second:
        assert second is first
        assert second.is_running()
        rid = second.add_request(PROMPTS[1], max_new_tokens=3)
        assert rid != manager_id
        assert_finished_like_generate(second.get_result(timeout=TIMEOUT), ref, PROMPTS[1], 3)
    assert not first.is_running()

    model.destroy_cached_continuous_batching_manager()
    assert getattr(model, CACHED_MANAGER_ATTR, None) is None
    assert first.engine is None
    with pytest.raises(RuntimeError, match="destroyed"):
        first.start()
    model.destroy_cached_continuous_batching_manager()  # nothing cached: a no-op


# -- submissions ------------------------------------------------------------------------------
def test_add_request_returns_the_id_and_output_matches_generate(manager, ref):
    manager.start()
    rid = manager.add_request(PROMPTS[2], request_id="mine", max_new_tokens=6)
    assert rid == "mine"
    auto = manager.add_request(torch.tensor(PROMPTS[3]), max_new_tokens=6)  # 1D tensors are accepted
    assert isinstance(auto, str) and auto != rid
    results = collect(manager, [rid, auto])
    assert_finished_like_generate(results[rid], ref, PROMPTS[2], 6)
    assert_finished_like_generate(results[auto], ref, PROMPTS[3], 6)
    assert results[rid].finish_reason == "length"
    assert_no_leak(manager)


def test_auto_generated_ids_are_unique(manager):
    explicit = [manager.add_request(PROMPTS[0], request_id=f"req_{i}", max_new_tokens=1) for i in (0, 2)]
    auto = [manager.add_request(PROMPTS[0], max_new_tokens=1) for _ in range(20)]
    ids = explicit + auto
    assert len(set(ids)) == len(ids)
    manager.start()
    assert set(collect(manager, ids)) == set(ids)


def test_duplicate_live_id_is_rejected_but_a_finished_id_can_be_reused(manager, ref):
    manager.add_request(PROMPTS[0], request_id="dup", max_new_tokens=3)
    with pytest.raises(ValueError, match="already in use"):
        manager.add_request(PROMPTS[1], request_id="dup", max_new_tokens=3)
    manager.start()
    assert_finished_like_generate(manager.get_result(timeout=TIMEOUT), ref, PROMPTS[0], 3)
    assert manager.add_request(PROMPTS[1], request_id="dup", max_new_tokens=3) == "dup"
    output = manager.get_result(request_id="dup", timeout=TIMEOUT)
    assert_finished_like_generate(output, ref, PROMPTS[1], 3)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"input_ids": []}, "empty prompt"),
        ({"input_ids": [5, 300]}, "outside the vocabulary"),
        ({"input_ids": [5, -1]}, "outside the vocabulary"),
        ({"input_ids": "hello"}, "expected a list of token ids"),
        ({"input_ids": [5, 6], "max_new_tokens": 0}, "max_new_tokens must be >= 1"),
        ({"input_ids": [5, 6], "max_new_tokens": -3}, "max_new_tokens must be >= 1"),
        ({"input_ids": [5] * 500, "max_new_tokens": 20}, "max_position_embeddings"),
        ({"input_ids": [5, 6], "request_id": 7}, "request_id must be a str"),
    ],
    ids=["empty", "oov", "negative-id", "str", "zero-new", "negative-new", "too-long", "id-type"],
)
def test_bad_submission_raises_and_the_manager_keeps_serving(manager, ref, kwargs, match):
    manager.start()
    kwargs.setdefault("max_new_tokens", 4)
    with pytest.raises(ValueError, match=match):
        manager.add_request(**kwargs)
    assert manager.is_running()
    rid = manager.add_request(PROMPTS[0], max_new_tokens=4)
    assert_finished_like_generate(manager.get_result(rid, timeout=TIMEOUT), ref, PROMPTS[0], 4)
    assert manager.stats().failed == 0


def test_request_that_can_never_fit_the_cache_is_rejected(model, ref):
    manager = new_manager(model, num_blocks=2)  # 2 pages of 16 tokens
    try:
        manager.start()
        with pytest.raises(ValueError, match="KV pages"):
            manager.add_request(list(range(3, 23)), max_new_tokens=20)
        rid = manager.add_request(PROMPTS[0], max_new_tokens=4)
        assert_finished_like_generate(manager.get_result(rid, timeout=TIMEOUT), ref, PROMPTS[0], 4)
    finally:
        manager.destroy()


def test_max_queue_size_raises_queue_full(model, ref):
    manager = new_manager(model, max_queue_size=2)
    try:
        ids = [manager.add_request(p, max_new_tokens=3) for p in PROMPTS[:2]]
        with pytest.raises(queue.Full):
            manager.add_request(PROMPTS[2], max_new_tokens=3)
        manager.start()
        results = collect(manager, ids)
        for rid, prompt in zip(ids, PROMPTS, strict=False):
            assert_finished_like_generate(results[rid], ref, prompt, 3)
        rid = manager.add_request(PROMPTS[2], max_new_tokens=3)  # room again
        assert_finished_like_generate(manager.get_result(rid, timeout=TIMEOUT), ref, PROMPTS[2], 3)
    finally:
        manager.destroy()


def test_add_requests_returns_ids_in_input_order(manager, ref):
    manager.start()
    ids = manager.add_requests(PROMPTS[:5], max_new_tokens=5)
    assert len(ids) == 5 and len(set(ids)) == 5
    results = collect(manager, ids)
    for rid, prompt in zip(ids, PROMPTS, strict=False):
        assert_finished_like_generate(results[rid], ref, prompt, 5)


def test_add_requests_error_names_the_index(manager, ref):
    with pytest.raises(ValueError, match=r"inputs\[1\].*empty prompt"):
        manager.add_requests([PROMPTS[0], [], PROMPTS[1]], max_new_tokens=3)
    with pytest.raises(ValueError, match=r"inputs\[2\].*outside the vocabulary"):
        manager.add_requests([PROMPTS[0], PROMPTS[1], [1, 2, 999]], max_new_tokens=3)
    manager.start()
    # Whatever was accepted before the bad input is still served; nothing else is affected.
    for output in run_with_timeout(lambda: list(manager)):
        assert output.status == RequestStatus.FINISHED
    rid = manager.add_request(PROMPTS[2], max_new_tokens=3)
    assert_finished_like_generate(manager.get_result(rid, timeout=TIMEOUT), ref, PROMPTS[2], 3)


# -- cancellation -----------------------------------------------------------------------------
def test_cancel_pending_request_before_start(manager, ref):
    rid = manager.add_request(PROMPTS[0], max_new_tokens=5)
    keep = manager.add_request(PROMPTS[1], max_new_tokens=5)
    manager.cancel_request(rid)
    output = manager.get_result(timeout=TIMEOUT)
    assert output.request_id == rid
    assert output.status == RequestStatus.CANCELLED
    assert output.generated_tokens == []
    engine = manager.engine
    engine.check_integrity()
    assert engine.cache.pool.num_free_pages == engine.cache.pool.num_pages
    manager.start()
    assert_finished_like_generate(manager.get_result(timeout=TIMEOUT), ref, PROMPTS[1], 5)
    assert manager.get_result(timeout=0.2) is None, "exactly one final result for the cancelled request"
    assert manager.stats().cancelled == 1
    assert keep != rid


def test_cancel_pending_request_while_paused(manager, ref):
    manager.start()
    with manager.pause():
        rid = manager.add_request(PROMPTS[0], max_new_tokens=5)
        other = manager.add_request(PROMPTS[1], max_new_tokens=5)
        manager.cancel_request(rid)
    results = collect(manager, [rid, other])
    assert results[rid].status == RequestStatus.CANCELLED
    assert results[rid].generated_tokens == []
    assert_finished_like_generate(results[other], ref, PROMPTS[1], 5)
    assert manager.get_result(timeout=0.2) is None
    assert_no_leak(manager)


def test_cancel_running_request_frees_its_pages(manager, ref):
    manager.start()
    long_id = manager.add_request(PROMPTS[4], max_new_tokens=400)
    short_id = manager.add_request(PROMPTS[5], max_new_tokens=6)
    wait_for(lambda: manager.engine.counters.generated_tokens >= 4, what="the long request to run")
    with manager.pause():
        assert manager.engine.cache.pool.num_used_pages > 0
        manager.cancel_request(long_id)
    results = collect(manager, [long_id, short_id])
    cancelled = results[long_id]
    assert cancelled.status == RequestStatus.CANCELLED
    assert 0 < len(cancelled.generated_tokens) < 400
    assert cancelled.generated_tokens == ref(PROMPTS[4], len(cancelled.generated_tokens))
    assert_finished_like_generate(results[short_id], ref, PROMPTS[5], 6)
    assert manager.get_result(timeout=0.2) is None
    assert_no_leak(manager)
    assert manager.stats().cancelled == 1


def test_cancel_unknown_or_finished_id_logs_a_warning(manager, ref, caplog):
    manager.start()
    with caplog.at_level(logging.WARNING, logger=MANAGER_LOGGER):
        manager.cancel_request("never-submitted")
    assert "never-submitted" in caplog.text
    rid = manager.add_request(PROMPTS[0], max_new_tokens=2)
    assert_finished_like_generate(manager.get_result(timeout=TIMEOUT), ref, PROMPTS[0], 2)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=MANAGER_LOGGER):
        manager.cancel_request(rid)
    assert rid in caplog.text
    assert manager.is_running()


# -- results ----------------------------------------------------------------------------------
def test_get_result_by_id_takes_that_request_and_keeps_the_others_in_place(manager, ref):
    manager.start()
    first = manager.add_request(PROMPTS[0], max_new_tokens=2)
    second = manager.add_request(PROMPTS[1], max_new_tokens=6)  # finishes after `first`
    third = manager.add_request(PROMPTS[2], max_new_tokens=7)
    manager.stop()  # graceful: all finished, their results wait in the queue
    assert_finished_like_generate(manager.get_result(request_id=second, timeout=1), ref, PROMPTS[1], 6)
    assert manager.get_result(request_id=second, timeout=0.1) is None, "delivered once"
    assert manager.get_result(request_id="never-submitted") is None, "nothing can come: no wait"
    assert_finished_like_generate(manager.get_result(timeout=1), ref, PROMPTS[0], 2)  # order kept
    assert_finished_like_generate(manager.get_result(request_id=third, timeout=1), ref, PROMPTS[2], 7)
    assert manager.get_result(timeout=0.1) is None
    assert first != second


def test_get_result_timeout_returns_none(manager):
    manager.start()
    assert manager.get_result(timeout=0.1) is None
    rid = manager.add_request(PROMPTS[0], max_new_tokens=400)
    assert manager.get_result(timeout=0.1) is None
    assert manager.get_result(request_id=rid, timeout=0.1) is None
    manager.cancel_request(rid)
    assert manager.get_result(timeout=TIMEOUT).status == RequestStatus.CANCELLED


def test_iteration_yields_all_unclaimed_results_then_ends(manager, ref):
    manager.start()
    ids = manager.add_requests(PROMPTS[:4], max_new_tokens=4)
    claimed = manager.add_request(PROMPTS[4], max_new_tokens=4, streaming=True)
    handled: list[GenerationOutput] = []
    manager.register_result_handler(claimed, handled.append)
    outputs = run_with_timeout(lambda: list(manager))
    assert sorted(o.request_id for o in outputs) == sorted(ids), "claimed requests are not iterated"
    by_id = {o.request_id: o for o in outputs}
    for rid, prompt in zip(ids, PROMPTS, strict=False):
        assert_finished_like_generate(by_id[rid], ref, prompt, 4)
    wait_for(lambda: handled and handled[-1].is_finished(), what="the handler's final result")
    assert_finished_like_generate(handled[-1], ref, PROMPTS[4], 4)
    assert run_with_timeout(lambda: list(manager)) == [], "nothing outstanding: iteration ends at once"


def test_iteration_after_stop_yields_the_remaining_results(manager, ref):
    manager.start()
    ids = manager.add_requests(PROMPTS[:3], max_new_tokens=3)
    manager.stop()
    outputs = run_with_timeout(lambda: list(manager))
    assert sorted(o.request_id for o in outputs) == sorted(ids)


def test_iteration_with_work_outstanding_but_not_started_raises(manager):
    manager.add_request(PROMPTS[0], max_new_tokens=3)
    with pytest.raises(RuntimeError, match="start"):
        run_with_timeout(lambda: list(manager))


# -- streaming ---------------------------------------------------------------------------------
def test_streaming_yields_growing_partials_then_finished(manager, ref):
    manager.start()
    rid = manager.add_request(PROMPTS[1], max_new_tokens=6, streaming=True)
    outputs = run_with_timeout(lambda: list(manager.request_id_iter(rid)))
    partial_lengths_ok(outputs)
    assert [len(o.generated_tokens) for o in outputs] == [1, 2, 3, 4, 5, 6]
    assert all(o.status in (RequestStatus.PREFILLING, RequestStatus.DECODING) for o in outputs[:-1])
    assert_finished_like_generate(outputs[-1], ref, PROMPTS[1], 6)
    assert manager.get_result(timeout=0.1) is None, "a claimed stream's final does not reach the queue"


def test_streaming_claimed_after_the_request_finished_replays_everything(manager, ref):
    manager.start()
    rid = manager.add_request(PROMPTS[2], max_new_tokens=5, streaming=True)
    wait_for(lambda: manager.stats().finished == 1, what="the request to finish")
    outputs = run_with_timeout(lambda: list(manager.request_id_iter(rid)))
    assert [len(o.generated_tokens) for o in outputs] == [1, 2, 3, 4, 5]
    partial_lengths_ok(outputs)
    assert_finished_like_generate(outputs[-1], ref, PROMPTS[2], 5)


def test_streaming_unclaimed_partials_and_final_go_to_get_result_in_order(manager, ref):
    manager.start()
    rid = manager.add_request(PROMPTS[2], max_new_tokens=4, streaming=True)
    outputs = [manager.get_result(timeout=TIMEOUT) for _ in range(4)]
    partial_lengths_ok(outputs)
    assert_finished_like_generate(outputs[-1], ref, PROMPTS[2], 4)
    with pytest.raises(KeyError, match="unknown request id"):
        manager.request_id_iter(rid)  # everything, the final included, was delivered


def test_request_id_iter_of_non_streaming_request_yields_only_the_final(manager, ref):
    manager.start()
    rid = manager.add_request(PROMPTS[3], max_new_tokens=4)
    outputs = run_with_timeout(lambda: list(manager.request_id_iter(rid)))
    assert len(outputs) == 1
    assert_finished_like_generate(outputs[0], ref, PROMPTS[3], 4)


def test_request_id_iter_of_unknown_id_raises(manager):
    manager.start()
    with pytest.raises(ValueError, match="unknown request id"):
        run_with_timeout(lambda: list(manager.request_id_iter("nope")))


# -- callbacks ---------------------------------------------------------------------------------
def test_result_handler_gets_partials_and_exactly_one_final(manager, ref):
    manager.start()
    streaming = manager.add_request(PROMPTS[0], max_new_tokens=5, streaming=True)
    plain = manager.add_request(PROMPTS[1], max_new_tokens=5)
    received: dict[str, list[GenerationOutput]] = {streaming: [], plain: []}
    manager.register_result_handler(streaming, received[streaming].append)
    manager.register_result_handler(plain, received[plain].append)
    wait_for(lambda: manager.stats().finished == 2, what="both requests")
    stream = received[streaming]
    assert [o.is_finished() for o in stream].count(True) == 1
    partial_lengths_ok(stream)
    assert_finished_like_generate(stream[-1], ref, PROMPTS[0], 5)
    assert len(received[plain]) == 1
    assert_finished_like_generate(received[plain][0], ref, PROMPTS[1], 5)
    assert manager.get_result(timeout=0.1) is None


def test_result_handler_that_raises_does_not_kill_the_manager(manager, ref, caplog):
    manager.start()
    seen: list[GenerationOutput] = []

    def bad_handler(output: GenerationOutput) -> None:
        seen.append(output)
        raise RuntimeError("handler bug")

    rid = manager.add_request(PROMPTS[0], max_new_tokens=4, streaming=True)
    with caplog.at_level(logging.ERROR):
        manager.register_result_handler(rid, bad_handler)
        wait_for(lambda: seen and seen[-1].is_finished(), what="the final result")
    assert "handler bug" in caplog.text
    assert manager.is_running()
    assert [o.is_finished() for o in seen].count(True) == 1
    assert_finished_like_generate(seen[-1], ref, PROMPTS[0], 4)
    rid = manager.add_request(PROMPTS[1], max_new_tokens=4)
    assert_finished_like_generate(manager.get_result(rid, timeout=TIMEOUT), ref, PROMPTS[1], 4)


def test_handler_registered_before_add_request_gets_every_output(manager, ref):
    """transformers serve registers its handler first (to not race a fast completion), then submits."""
    received: list[GenerationOutput] = []
    manager.register_result_handler("early", received.append)
    manager.register_result_handler("refused", received.append)
    with pytest.raises(ValueError, match="empty prompt"):
        manager.add_request([], request_id="refused", max_new_tokens=3)  # its early handler is dropped
    manager.start()
    assert manager.add_request(PROMPTS[0], request_id="early", max_new_tokens=4, streaming=True) == "early"
    wait_for(lambda: received and received[-1].is_finished(), what="the final output")
    partial_lengths_ok(received)
    assert_finished_like_generate(received[-1], ref, PROMPTS[0], 4)
    assert manager.get_result(timeout=0.1) is None
    rid = manager.add_request(PROMPTS[1], request_id="refused", max_new_tokens=2)
    assert_finished_like_generate(manager.get_result(rid, timeout=TIMEOUT), ref, PROMPTS[1], 2)
    assert len(received) == 4, "the dropped handler got nothing"


# -- asyncio -----------------------------------------------------------------------------------
def test_asyncio_streams_run_concurrently(manager, ref):
    manager.start()
    prompts = PROMPTS[:3]

    async def consume(rid: str) -> list[GenerationOutput]:
        return [output async for output in manager.stream(rid)]

    async def main():
        ids = [manager.add_request(p, max_new_tokens=5, streaming=True) for p in prompts]
        plain = manager.add_request(PROMPTS[3], max_new_tokens=5)
        streams = await asyncio.wait_for(asyncio.gather(*(consume(r) for r in [*ids, plain])), TIMEOUT)
        return ids, streams

    ids, streams = run_with_timeout(lambda: asyncio.run(main()))
    for prompt, outputs in zip(prompts, streams, strict=False):
        partial_lengths_ok(outputs)
        assert [len(o.generated_tokens) for o in outputs] == [1, 2, 3, 4, 5]
        assert_finished_like_generate(outputs[-1], ref, prompt, 5)
    assert len(streams[-1]) == 1
    assert_finished_like_generate(streams[-1][0], ref, PROMPTS[3], 5)
    assert [o.request_id for o in streams[0]] == [ids[0]] * 5


# -- stop / hard stop / destroy -----------------------------------------------------------------
def test_graceful_stop_completes_queued_and_active_requests(manager, ref, caplog):
    manager.start()
    ids = manager.add_requests(PROMPTS[:5], max_new_tokens=5)
    manager.stop()
    assert not manager.is_running()
    results = collect(manager, ids, timeout=1)
    for rid, prompt in zip(ids, PROMPTS, strict=False):
        assert_finished_like_generate(results[rid], ref, prompt, 5)
    with caplog.at_level(logging.WARNING, logger=MANAGER_LOGGER):
        assert manager.add_request(PROMPTS[0], max_new_tokens=3) is None
    assert "refused" in caplog.text
    assert manager.add_requests(PROMPTS[:2], max_new_tokens=3) is None
    assert manager.get_result(timeout=0.1) is None
    manager.engine.check_integrity()
    assert manager.engine.cache.pool.num_free_pages == manager.engine.cache.pool.num_pages

    manager.start()  # a new session on the same manager
    rid = manager.add_request(PROMPTS[6], max_new_tokens=5)
    assert rid is not None and rid not in ids
    assert_finished_like_generate(manager.get_result(timeout=TIMEOUT), ref, PROMPTS[6], 5)


def test_non_blocking_stop_returns_and_the_thread_ends(manager, ref):
    manager.start()
    rid = manager.add_request(PROMPTS[0], max_new_tokens=4)
    manager.stop(block=False)
    wait_for(lambda: not manager.is_running(), what="the thread to end")
    assert_finished_like_generate(manager.get_result(rid, timeout=1), ref, PROMPTS[0], 4)


def test_start_right_after_a_non_blocking_stop_starts_a_new_session(manager, ref):
    manager.start()
    first = manager.add_request(PROMPTS[0], max_new_tokens=8)
    manager.stop(block=False)  # the thread is still draining `first`
    manager.start()
    assert manager.is_running()
    second = manager.add_request(PROMPTS[1], max_new_tokens=3)
    assert second is not None, "start() after stop() accepts submissions again"
    results = collect(manager, [first, second])
    assert_finished_like_generate(results[first], ref, PROMPTS[0], 8)
    assert_finished_like_generate(results[second], ref, PROMPTS[1], 3)
    assert manager.is_running()


def test_hard_stop_fails_pending_and_running_requests(manager):
    manager.start()
    running = [manager.add_request(p, max_new_tokens=400) for p in PROMPTS[:2]]
    wait_for(lambda: manager.engine.counters.generated_tokens >= 2, what="requests to run")
    with manager.pause():
        pending = manager.add_request(PROMPTS[2], max_new_tokens=5)
        manager.stop(hard_stop=True)
    assert not manager.is_running()
    results = collect(manager, [*running, pending], timeout=1)
    for output in results.values():
        assert output.status == RequestStatus.FAILED
        assert "RuntimeError" in output.error
    assert results[pending].generated_tokens == []
    assert manager.get_result(timeout=0.1) is None
    manager.engine.check_integrity()
    assert manager.engine.cache.pool.num_free_pages == manager.engine.cache.pool.num_pages
    assert manager.stats().failed == 3


def test_hard_stop_of_a_manager_never_started_fails_its_queue(manager):
    ids = manager.add_requests(PROMPTS[:3], max_new_tokens=3)
    manager.stop(hard_stop=True)
    results = collect(manager, ids, timeout=1)
    assert {o.status for o in results.values()} == {RequestStatus.FAILED}
    assert all("RuntimeError" in o.error for o in results.values())


def test_destroy_then_start_raises(manager):
    manager.start()
    manager.destroy()
    assert not manager.is_running()
    assert manager.engine is None
    with pytest.raises(RuntimeError, match="destroyed and cannot be restarted"):
        manager.start()
    with pytest.raises(RuntimeError, match="destroyed"):
        manager.add_request(PROMPTS[0], max_new_tokens=2)
    manager.destroy()  # twice is harmless


# -- pause --------------------------------------------------------------------------------------
def test_pause_holds_the_loop_and_keeps_in_flight_requests(manager, ref):
    manager.start()
    ids = manager.add_requests(PROMPTS[:2], max_new_tokens=24)
    engine = manager.engine
    wait_for(lambda: engine.counters.steps >= 2, what="a few steps")
    with manager.pause():
        steps, used = engine.counters.steps, engine.cache.pool.num_used_pages
        running = [r.request_id for r in engine.scheduler.running]
        time.sleep(0.3)
        assert engine.counters.steps == steps, "no step runs while paused"
        assert engine.cache.pool.num_used_pages == used > 0
        assert sorted(running) == sorted(ids), "in-flight requests are kept"
        engine.check_integrity()
        with torch.no_grad():
            manager.model.lm_head.weight.mul_(1.0)  # an in-place weight update
        assert manager.is_running()
    results = collect(manager, ids)
    for rid, prompt in zip(ids, PROMPTS, strict=False):
        assert_finished_like_generate(results[rid], ref, prompt, 24)
    assert_no_leak(manager)


def test_weights_updated_during_pause_are_used_by_new_requests(manager, model, ref):
    new_weights = make_model(seed=1)
    manager.start()
    rid = manager.add_request(PROMPTS[0], max_new_tokens=5)
    assert_finished_like_generate(manager.get_result(rid, timeout=TIMEOUT), ref, PROMPTS[0], 5)
    with manager.pause(), torch.no_grad():
        for param, new in zip(model.parameters(), new_weights.parameters(), strict=True):
            param.copy_(new)
    rid = manager.add_request(PROMPTS[0], max_new_tokens=5)
    output = manager.get_result(rid, timeout=TIMEOUT)
    assert output.status == RequestStatus.FINISHED
    assert output.generated_tokens == greedy_reference(new_weights, PROMPTS[0], 5)
    assert output.generated_tokens != ref(PROMPTS[0], 5)


def test_pause_of_a_manager_not_running_does_not_block(manager):
    def pause_briefly() -> None:
        with manager.pause():
            pass

    run_with_timeout(pause_briefly, timeout=5)


# -- stats --------------------------------------------------------------------------------------
def test_stats_counts(manager, ref):
    assert isinstance(manager.stats(), ManagerStats)
    manager.start()
    runner = manager.engine.runner
    original = runner._forward
    fail_next = threading.Event()

    def flaky_forward(step):
        if fail_next.is_set():
            fail_next.clear()
            raise RuntimeError("injected")
        return original(step)

    runner._forward = flaky_forward
    ids = manager.add_requests(PROMPTS[:3], max_new_tokens=4)
    collect(manager, ids)
    cancelled = manager.add_request(PROMPTS[3], max_new_tokens=400)
    wait_for(lambda: manager.stats().running == 1, what="the long request to run")
    manager.cancel_request(cancelled)
    collect(manager, [cancelled])
    with manager.pause():
        failed = manager.add_request(PROMPTS[4], max_new_tokens=4)
        fail_next.set()
    assert manager.get_result(failed, timeout=TIMEOUT).status == RequestStatus.FAILED

    stats = manager.stats()
    assert (stats.finished, stats.failed, stats.cancelled) == (3, 1, 1)
    assert (stats.queued, stats.running, stats.pages_in_use) == (0, 0, 0)
    assert stats.pages_total == 64
    assert stats.prefill_tokens >= sum(len(p) for p in PROMPTS[:4])
    assert stats.decode_tokens >= 3 * 3
    assert stats.preemptions == 0
    assert 0.0 <= stats.prefix_cache_hit_rate <= 1.0
    assert stats.tokens_per_second >= 0.0


def test_stats_count_preemptions_and_outputs_stay_exact(model, ref):
    manager = new_manager(model, num_blocks=5)  # 80 tokens of cache for 3 requests of up to 40
    try:
        manager.start()
        prompts = PROMPTS[:3]
        ids = manager.add_requests(prompts, max_new_tokens=30)
        results = collect(manager, ids)
        for rid, prompt in zip(ids, prompts, strict=True):
            assert_finished_like_generate(results[rid], ref, prompt, 30)
        stats = manager.stats()
        assert stats.preemptions > 0
        assert stats.finished == 3 and stats.pages_in_use == 0 and stats.pages_total == 5
        assert_no_leak(manager)
    finally:
        manager.destroy()


# -- fault isolation ----------------------------------------------------------------------------
def test_forward_failure_fails_only_the_requests_of_that_step(manager, ref):
    manager.start()
    runner = manager.engine.runner
    original = runner._forward
    calls = {"n": 0, "fail_at": None}

    def flaky_forward(step):
        calls["n"] += 1
        if calls["n"] == calls["fail_at"]:
            raise RuntimeError("injected kernel error")
        return original(step)

    runner._forward = flaky_forward
    before = manager.add_request(PROMPTS[0], max_new_tokens=3)
    assert_finished_like_generate(manager.get_result(before, timeout=TIMEOUT), ref, PROMPTS[0], 3)
    with manager.pause():
        doomed = manager.add_requests(PROMPTS[1:3], max_new_tokens=4)
        calls["fail_at"] = calls["n"] + 2  # their second step (first decode) raises
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

    def flaky_schedule():
        if fail_next.is_set():
            fail_next.clear()
            raise ValueError("injected scheduler bug")
        return original()

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
    original_step = manager._step
    calls = {"n": 0}

    def dying_step(engine):
        calls["n"] += 1
        if calls["n"] == 3:
            raise _Die("injected thread death")
        return original_step(engine)

    manager._step = dying_step
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
    wait_for(lambda: not manager.is_running(), timeout=5, what="the thread to end")
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
        run_with_timeout(lambda: manager.get_result(), timeout=5)
    with pytest.raises(ManagerDeadError):
        run_with_timeout(lambda: list(manager), timeout=5)
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

    manager._fail_everything = broken_fail_everything
    manager._step = dying_step
    try:
        manager.start()
        manager.add_request(PROMPTS[0], max_new_tokens=3)
        with pytest.raises(ManagerDeadError):
            run_with_timeout(lambda: manager.get_result(), timeout=10)
        wait_for(lambda: not manager.is_running(), timeout=5, what="the thread to end")
    finally:
        del manager._fail_everything  # back to the real one for the fixture's teardown


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

    results = collect(manager, [rid for rid, _ in accepted], timeout=5)
    assert manager.get_result(timeout=0.1) is None, "no extra results"
    for rid, prompt in accepted:
        output = results[rid]
        if hard_stop and output.status == RequestStatus.FAILED:
            assert "RuntimeError" in output.error
        else:
            assert_finished_like_generate(output, ref, prompt, 2)
    manager.engine.check_integrity()
    assert manager.engine.cache.pool.num_free_pages == manager.engine.cache.pool.num_pages


# -- thread safety ------------------------------------------------------------------------------
def test_concurrent_submit_cancel_and_read(manager, ref):
    manager.start()
    submitted: list[tuple[str, list[int]]] = []
    to_cancel: queue.SimpleQueue[str] = queue.SimpleQueue()
    cancelled: set[str] = set()
    results: list[GenerationOutput] = []
    lock = threading.Lock()
    submitters_done = threading.Event()
    deadline = time.monotonic() + 60

    def submitter(k: int) -> None:
        for i in range(10):
            prompt = PROMPTS[(3 * k + i) % len(PROMPTS)]
            rid = manager.add_request(prompt, max_new_tokens=3)
            assert rid is not None
            with lock:
                submitted.append((rid, prompt))
            to_cancel.put(rid)

    def canceller() -> None:
        seen = 0
        while not (submitters_done.is_set() and to_cancel.empty()):
            try:
                rid = to_cancel.get(timeout=0.01)
            except queue.Empty:
                continue
            seen += 1
            if seen % 3 == 0:
                with lock:
                    cancelled.add(rid)
                manager.cancel_request(rid)

    def reader() -> None:
        while time.monotonic() < deadline:
            with lock:
                if submitters_done.is_set() and len(results) >= len(submitted):
                    return
            output = manager.get_result(timeout=0.05)
            if output is not None:
                with lock:
                    results.append(output)

    submitters = [threading.Thread(target=submitter, args=(k,), daemon=True) for k in range(4)]
    others = [threading.Thread(target=t, daemon=True) for t in (canceller, reader, reader)]
    for thread in submitters + others:
        thread.start()
    for thread in submitters:
        thread.join(TIMEOUT)
    submitters_done.set()
    for thread in others:
        thread.join(70)
        assert not thread.is_alive()

    assert len(submitted) == 40
    counts = Counter(o.request_id for o in results)
    assert counts == Counter(rid for rid, _ in submitted), "every id gets exactly one final result"
    prompts = dict(submitted)
    for output in results:
        if output.status == RequestStatus.CANCELLED:
            assert output.request_id in cancelled
            assert output.generated_tokens == ref(prompts[output.request_id], len(output.generated_tokens))
        else:
            assert_finished_like_generate(output, ref, prompts[output.request_id], 3)
    assert manager.get_result(timeout=0.1) is None
    assert_no_leak(manager)


def test_generate_batch_and_the_manager_give_identical_outputs(model, ref):
    prompts = PROMPTS[:6]
    config = ContinuousBatchingConfig(**CB_CONFIG)
    batch = model.generate_batch(
        prompts, max_new_tokens=6, continuous_batching_config=config, progress_bar=False
    )
    with model.continuous_batching_context_manager(continuous_batching_config=config) as manager:
        ids = manager.add_requests(prompts, max_new_tokens=6)
        results = collect(manager, ids)
    for (batch_id, batch_output), rid, prompt in zip(batch.items(), ids, prompts, strict=True):
        assert batch_output.generated_tokens == results[rid].generated_tokens, batch_id
        assert_finished_like_generate(results[rid], ref, prompt, 6)
