"""A hypothesis state machine over one ContinuousBatchingManager per example.

Rules: add (plain / streaming left unclaimed / streaming claimed by a handler; one or two forked sequences), cancel (known or
unknown ids), get_result (any, or a given id), one chunk of a stream through a *new* `request_id_iter`
per chunk (transformers' own pattern), stop (graceful or hard, blocking or not), start. At teardown the
manager is drained (started if needed, stopped gracefully, unclaimed streams claimed late, the
queue emptied) and the invariants are checked:
- every submitted id received exactly one final result (queue, handler or stream), and every output of a
  streaming request reached someone exactly once and in order (partials taken from the shared queue, by
  single-chunk iterators, and by the late claim, put together, form one gap-free stream);
- finished greedy outputs equal plain `generate()`; cancelled / hard-stopped ones are prefixes of it;
- streamed partials grow by one token and are prefixes of the final;
- no page leaks: the pool is consistent and all pages are free once the thread is stopped.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tests.support.models import tiny_llama_without_eos
from tests.support.prompts import prompts_of_lengths
from tests.support.reference import greedy_reference
from tests.support.threads import TIMEOUT, call_in_thread, run_with_timeout
from transformers_cb import ContinuousBatchingConfig, GenerationOutput, RequestStatus

MAX_NEW = 8
PROMPTS = prompts_of_lengths([3, 6, 9, 12, 17], seed=7)


MODEL = tiny_llama_without_eos()  # driven by the managers (switched to paged attention while a thread runs)
REFERENCE_MODEL = tiny_llama_without_eos()  # same weights, only ever runs plain generate()
_REFERENCES: dict[int, list[int]] = {}


def reference(prompt_index: int, max_new_tokens: int) -> list[int]:
    """Greedy `generate()` on a separate copy of the weights; shorter runs are prefixes (no eos)."""
    if prompt_index not in _REFERENCES:
        _REFERENCES[prompt_index] = greedy_reference(REFERENCE_MODEL, PROMPTS[prompt_index], MAX_NEW)
    return _REFERENCES[prompt_index][:max_new_tokens]


def _drain_stream(manager, request_id: str) -> list[GenerationOutput]:
    """`request_id_iter` in a helper thread so that a bug fails instead of hanging."""
    return run_with_timeout(
        lambda: list(manager.request_id_iter(request_id)), what=f"request_id_iter({request_id!r})"
    )


class ManagerMachine(RuleBasedStateMachine):
    CB_CONFIG = ContinuousBatchingConfig(page_size=16, num_blocks=24)

    def __init__(self) -> None:
        super().__init__()
        self.manager = MODEL.init_continuous_batching(continuous_batching_config=self.CB_CONFIG)
        self.accepting = True  # a new manager queues submissions until start()
        self.requests: dict[str, tuple[int, int, str]] = {}  # id -> (prompt index, max_new, mode)
        self.taken: dict[str, GenerationOutput] = {}  # finals taken with get_result
        self.seen: dict[str, list[GenerationOutput]] = {}  # every output of a stream, in delivery order
        self.handled: dict[str, list[GenerationOutput]] = {}  # outputs delivered to handlers
        self.cancel_requested: set[str] = set()
        self.may_fail: set[str] = set()  # live at a hard stop, or queued at a stop of a manager not running

    # -- rules --------------------------------------------------------------------------
    @rule(
        prompt=st.integers(0, len(PROMPTS) - 1),
        max_new=st.integers(1, MAX_NEW),
        mode=st.sampled_from(["plain", "stream", "handler"]),
        named=st.booleans(),
        forks=st.sampled_from([1, 1, 2]),
    )
    def add(self, prompt: int, max_new: int, mode: str, named: bool, forks: int) -> None:
        request_id = f"mine-{len(self.requests)}" if named else None
        rid = self.manager.add_request(
            PROMPTS[prompt],
            request_id=request_id,
            max_new_tokens=max_new,
            streaming=mode != "plain",
            num_return_sequences=forks,  # siblings `<rid>__child#<i>` share the prompt's pages
        )
        if not self.accepting:
            assert rid is None, "a stopped manager refuses submissions"
            return
        assert rid is not None and rid not in self.requests
        assert request_id is None or rid == request_id
        for member in [rid, *(f"{rid}__child#{i}" for i in range(forks - 1))]:
            self.requests[member] = (prompt, max_new, mode)
            if mode == "handler":
                outputs: list[GenerationOutput] = []
                self.handled[member] = outputs
                self.manager.register_result_handler(member, outputs.append)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def cancel(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.requests)))
        self.cancel_requested.add(rid)
        self.manager.cancel_request(rid)  # finished already: only a warning

    @rule()
    def cancel_unknown(self) -> None:
        self.manager.cancel_request("never-submitted")

    @rule()
    def get_any_result(self) -> None:
        self._take(self.manager.get_result(timeout=0.02), None)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def get_result_for(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.requests)))
        self._take(self.manager.get_result(request_id=rid, timeout=0.02), rid)

    @precondition(lambda self: any(mode == "stream" for _, _, mode in self.requests.values()))
    @rule(data=st.data())
    def next_chunk_of_a_new_iterator(self, data) -> None:
        """`next(manager.request_id_iter(rid))`: a new iterator per chunk resumes where the last stopped."""
        streams = sorted(rid for rid, (_, _, mode) in self.requests.items() if mode == "stream")
        rid = data.draw(st.sampled_from(streams))
        finished = any(o.is_finished() for o in self.seen.get(rid, []))
        if finished:
            with pytest.raises(KeyError, match=rid):  # its final output was delivered: nothing left
                self.manager.request_id_iter(rid)
            return
        output, error = call_in_thread(
            lambda: next(self.manager.request_id_iter(rid)), what=f"next(request_id_iter({rid!r}))"
        )
        if error is not None:
            # Nothing buffered and no thread to produce it: a clear RuntimeError, never a hang.
            assert isinstance(error, RuntimeError) and not self.manager.is_running(), error
            return
        self._record(output)

    @rule(hard=st.booleans(), block=st.booleans())
    def stop(self, hard: bool, block: bool) -> None:
        was_running = self.manager.is_running()
        self.manager.stop(block=block, hard_stop=hard, timeout=TIMEOUT)
        self.accepting = False
        if hard or not was_running:  # nothing will run what is queued: it fails with a reason
            self.may_fail |= set(self.requests)
        if block:
            assert not self.manager.is_running()
            self._check_pages()

    @rule()
    def start(self) -> None:
        self.manager.start()
        assert self.manager.is_running()
        self.accepting = True

    @invariant()
    def stats_are_consistent(self) -> None:
        stats = self.manager.stats()
        assert stats.finished + stats.failed + stats.cancelled <= len(self.requests)
        assert 0 <= stats.pages_in_use <= stats.pages_total

    # -- helpers ------------------------------------------------------------------------
    def _take(self, output: GenerationOutput | None, wanted: str | None) -> None:
        if output is None:
            return
        assert wanted is None or output.request_id == wanted
        assert self.requests[output.request_id][2] != "handler", "a claimed request reached the queue"
        if not output.is_finished():
            assert self.requests[output.request_id][2] == "stream", "a partial output of a plain request"
        self._record(output)

    def _record(self, output: GenerationOutput) -> None:
        rid = output.request_id
        assert rid not in self.taken, "an output after the final one"
        if self.requests[rid][2] == "stream":
            self.seen.setdefault(rid, []).append(output)
        if output.is_finished():
            self.taken[rid] = output

    def _check_pages(self) -> None:
        """Only when the thread is stopped: nothing else touches the engine then."""
        engine = self.manager.engine
        engine.check_integrity()  # with offload on: the host pools and the swapped-out requests too
        if not engine.has_work():
            assert engine.num_used_pages == 0
            assert engine.offload is None or engine.offload.host.num_used_pages == 0

    def _check_final(self, rid: str, final: GenerationOutput) -> None:
        prompt, max_new, _mode = self.requests[rid]
        assert final.request_id == rid
        assert final.prompt_ids == PROMPTS[prompt]
        expected = reference(prompt, max_new)
        if final.status == RequestStatus.FINISHED:
            assert final.generated_tokens == expected, rid
        elif final.status == RequestStatus.CANCELLED:
            assert rid in self.cancel_requested
            assert final.generated_tokens == expected[: len(final.generated_tokens)]
        else:
            assert final.status == RequestStatus.FAILED, final
            assert rid in self.may_fail and "RuntimeError" in final.error
            assert final.generated_tokens == expected[: len(final.generated_tokens)]

    @staticmethod
    def _check_stream(outputs: list[GenerationOutput]) -> None:
        *partials, final = outputs
        assert final.is_finished() and not any(p.is_finished() for p in partials)
        assert [len(p.generated_tokens) for p in partials] == list(range(1, len(partials) + 1))
        for partial in partials:
            assert final.generated_tokens[: len(partial.generated_tokens)] == partial.generated_tokens

    def teardown(self) -> None:
        manager = self.manager
        try:
            if not manager.is_running():
                manager.start()
            manager.stop(timeout=TIMEOUT)  # graceful: everything queued completes
            assert not manager.is_running()
            self._check_pages()

            finals: Counter[str] = Counter()
            for rid, (_prompt, _max_new, mode) in self.requests.items():
                if mode == "stream" and rid not in self.taken:
                    for output in _drain_stream(manager, rid):  # a late claim: every undelivered output
                        self._record(output)
                if mode == "handler":
                    outputs = self.handled[rid]
                    assert outputs, f"handler of {rid} got nothing"
                    self._check_stream(outputs)
                    finals[rid] += 1
                    self._check_final(rid, outputs[-1])
            while (output := manager.get_result(timeout=1)) is not None:  # plain requests' finals
                assert not output.is_finished() or output.request_id not in self.taken, "second final"
                self._take(output, None)
            for rid, (_prompt, _max_new, mode) in self.requests.items():
                if mode == "stream":
                    self._check_stream(self.seen[rid])
            finals.update(self.taken.keys())
            for rid, output in self.taken.items():
                self._check_final(rid, output)
            assert finals == Counter(self.requests.keys()), "every submitted id gets exactly one final result"
            assert manager.stats().finished + manager.stats().failed + manager.stats().cancelled == len(
                self.requests
            )
        finally:
            if manager.engine is not None:
                manager.stop(hard_stop=True, timeout=TIMEOUT)
                manager.destroy()


# Derandomized in CI by the "ci" Hypothesis profile (conftest.py); see docs/conformance.md to reproduce.
ManagerMachine.TestCase.settings = settings(
    max_examples=15,
    stateful_step_count=15,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestManagerStateMachine = ManagerMachine.TestCase


# Host page of the tiny Llama at page_size 4: 2 (K, V) x 2 layers x 4 tokens x 2 KV heads x 16 dims x 4 bytes.
HOST_PAGE_BYTES = 2048


class OffloadManagerMachine(ManagerMachine):
    """The same rules with CPU offload on and a device cache of 6 pages of 4 tokens, what the largest
    request needs: requests are preempted and swap out to a host tier of 4 pages (or recompute when it
    is full or they are bigger); cancels and stops may hit swapped-out requests too."""

    CB_CONFIG = ContinuousBatchingConfig(
        page_size=4, num_blocks=8, cpu_offload_space=8 * HOST_PAGE_BYTES / 2**30
    )


OffloadManagerMachine.TestCase.settings = ManagerMachine.TestCase.settings
TestOffloadManagerStateMachine = OffloadManagerMachine.TestCase
