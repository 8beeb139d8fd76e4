"""ContinuousBatchingManager thread safety: concurrent submit, cancel and read from several threads, and
`generate_batch` and the manager giving identical outputs."""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter

from tests.support.manager import (
    CB_CONFIG,
    PROMPTS,
    assert_finished_like_generate,
    assert_no_leak,
    collect,
)
from tests.support.threads import TIMEOUT
from transformers_cb import (
    ContinuousBatchingConfig,
    GenerationOutput,
    RequestStatus,
)


def test_concurrent_submit_cancel_and_read(manager, ref):
    manager.start()
    submitted: list[tuple[str, list[int]]] = []
    to_cancel: queue.SimpleQueue[str] = queue.SimpleQueue()
    cancelled: set[str] = set()
    results: list[GenerationOutput] = []
    lock = threading.Lock()
    submitters_done = threading.Event()
    deadline = time.monotonic() + TIMEOUT

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
