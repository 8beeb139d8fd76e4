"""ContinuousBatchingManager result routing: `get_result` (by id, timeout), iteration, streaming through
`request_id_iter` (claimed late, unclaimed, non-streaming), result handlers, and asyncio streams."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import pickle
import threading

import pytest

from tests.support.counting import CountingList, count_request_reads
from tests.support.manager import (
    PROMPTS,
    assert_finished_like_generate,
    partial_lengths_ok,
)
from tests.support.threads import TIMEOUT, run_with_timeout, wait_for
from transformers_cb import (
    GenerationOutput,
    RequestStatus,
)
from transformers_cb.requests import Request


# -- results ----------------------------------------------------------------------------------
def test_get_result_by_id_takes_that_request_and_keeps_the_others_in_place(manager, ref):
    manager.start()
    first = manager.add_request(PROMPTS[0], max_new_tokens=2)
    second = manager.add_request(PROMPTS[1], max_new_tokens=6)  # finishes after `first`
    third = manager.add_request(PROMPTS[2], max_new_tokens=7)
    manager.stop()  # graceful: all finished, their results wait in the queue
    assert_finished_like_generate(manager.get_result(request_id=second, timeout=TIMEOUT), ref, PROMPTS[1], 6)
    assert manager.get_result(request_id=second, timeout=0.1) is None, "delivered once"
    assert manager.get_result(request_id="never-submitted") is None, "nothing can come: no wait"
    assert_finished_like_generate(manager.get_result(timeout=TIMEOUT), ref, PROMPTS[0], 2)  # order kept
    assert_finished_like_generate(manager.get_result(request_id=third, timeout=TIMEOUT), ref, PROMPTS[2], 7)
    assert manager.get_result(timeout=0.1) is None
    assert first != second


def test_get_result_timeout_returns_none(manager):
    manager.start()
    assert manager.get_result(timeout=0.1) is None
    # The request's forward waits on `release`: on a fast machine 400 tokens of the tiny model
    # took less than the two 0.1 s waits below (CI failed so), and no wait may rest on speed.
    release = threading.Event()
    runner = manager.engine.runner
    original = runner._forward
    runner._forward = lambda step: (release.wait(TIMEOUT), original(step))[1]
    rid = manager.add_request(PROMPTS[0], max_new_tokens=400)
    assert manager.get_result(timeout=0.1) is None
    assert manager.get_result(request_id=rid, timeout=0.1) is None
    manager.cancel_request(rid)
    release.set()
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


def test_streamed_deltas_concatenate_to_the_final_output(manager, ref):
    manager.start()
    rid = manager.add_request(PROMPTS[3], max_new_tokens=9, streaming=True, return_logprobs=True)
    outputs = run_with_timeout(lambda: list(manager.request_id_iter(rid)))
    final = outputs[-1]
    assert_finished_like_generate(final, ref, PROMPTS[3], 9)
    assert [len(o.new_tokens) for o in outputs] == [1] * 9, "each output carries its one new token"
    assert [t for o in outputs for t in o.new_tokens] == final.generated_tokens
    assert [lp for o in outputs for lp in o.new_logprobs] == final.logprobs
    # The full lists stay where the API returns them, each output as it was when published.
    assert [o.generated_tokens for o in outputs] == [final.generated_tokens[:k] for k in range(1, 10)]
    assert [len(o.logprobs) for o in outputs] == list(range(1, 10))


def test_a_streamed_step_reads_its_new_tokens_only_not_the_growing_lists():
    """O(N) for a stream of N tokens: publishing an output and taking its delta read the new items, never
    a copy of everything so far (what a full list costs is paid only by whoever reads it)."""
    request = Request("r", [1, 2, 3], max_new_tokens=2000, streaming=True, record_timestamps=True)
    count_request_reads(request)
    tokens = []
    for step in range(2000):
        request.append_token(step % 50, -1.0, {step % 50: -1.0})
        output = request.to_output()
        tokens += output.new_tokens
        assert output.new_logprobs == [-1.0] and output.new_top_logprobs == [{step % 50: -1.0}]
    assert tokens == [step % 50 for step in range(2000)]
    assert CountingList.read <= 3 * 2000, "each step reads its new items (tokens, logprobs, top logprobs)"
    assert output.generated_tokens == tokens  # the full list, copied now that it is read
    assert CountingList.read <= 4 * 2000


def test_an_output_reads_like_a_plain_dataclass_of_lists():
    request = Request("r", [1, 2, 3], max_new_tokens=8, record_timestamps=True)
    request.append_token(7, -0.5)
    first = request.to_output()
    request.append_token(8, -0.25)
    second = request.to_output()
    assert (first.generated_tokens, first.logprobs, len(first.timestamps)) == ([7], [-0.5], 1)
    assert (second.new_tokens, second.generated_tokens, second.new_logprobs) == ([8], [7, 8], [-0.25])
    assert isinstance(second.generated_tokens, list) and second.generated_tokens is second.generated_tokens
    second.generated_tokens.append(99)  # the user's own copy: the request is untouched
    assert request.generated_ids == [7, 8] and request.to_output().generated_tokens == [7, 8]
    for copied in (pickle.loads(pickle.dumps(first)), copy.deepcopy(first), dataclasses.replace(first)):
        assert copied == first and copied.prompt_ids == [1, 2, 3] and copied.generated_tokens == [7]
    assert dataclasses.asdict(first)["generated_tokens"] == [7]
    by_hand = GenerationOutput("h", [1], [5, 6], RequestStatus.FINISHED)
    assert by_hand.new_tokens == [5, 6] and by_hand.new_logprobs is None and by_hand.logprobs is None
    with pytest.raises(TypeError, match="generated_tokens"):
        GenerationOutput("h", [1])  # still required, as every field without a default
    # The dataclass itself is unchanged: its fields, their types and defaults.
    assert [(f.name, f.type) for f in dataclasses.fields(GenerationOutput)][:4] == [
        ("request_id", "str"),
        ("prompt_ids", "list[int]"),
        ("generated_tokens", "list[int]"),
        ("status", "RequestStatus"),
    ]
    assert GenerationOutput.logprobs is None and GenerationOutput.timestamps is None
    # transformers' 14 fields first; ours after them, fields too, so replace() and asdict() keep them
    names = [f.name for f in dataclasses.fields(GenerationOutput)]
    assert names[14:] == [
        "draft_tokens",
        "accepted_draft_tokens",
        "weight_version_runs",
        "kv_weight_version",
        "new_from",
    ]
    counted = dataclasses.replace(
        by_hand, draft_tokens=4, accepted_draft_tokens=3, weight_version_runs=((0, 2),)
    )
    copied = dataclasses.replace(counted)
    assert (copied.draft_tokens, copied.accepted_draft_tokens, copied.weight_version_first) == (4, 3, 2)
    assert dataclasses.asdict(counted)["accepted_draft_tokens"] == 3


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
