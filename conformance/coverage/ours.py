"""Our continuous batching on one subject: the blocking API and the background manager.

- `generate_batch` with 4-token pages, a 16-token step budget (every prompt is prefilled in chunks) and
  prefix sharing on (prompt 2 starts with prompt 0's first four pages);
- the manager (`init_continuous_batching`, `start`, `add_requests`, results) with a cache a little larger
  than the largest request, so that requests are preempted and recomputed; a thread that dies or stops
  delivering is a crash.
"""

from __future__ import annotations

import time

from transformers_cb import ContinuousBatchingConfig

from .build import MAX_NEW_TOKENS, PROMPT_LENGTHS, Generated, Subject, greedy
from .judge import RunFailed, judge, judge_error
from .outcome import Outcome

PAGE_SIZE = 4
STEP_TOKENS = 16
# Pages of the largest request, plus two: the others must wait or be preempted.
SMALL_CACHE_PAGES = -(-(max(PROMPT_LENGTHS) + MAX_NEW_TOKENS) // PAGE_SIZE) + 2
RESULT_TIMEOUT_S = 60.0


def generated(out) -> Generated:
    return Generated(list(out.generated_tokens), list(out.logprobs) if out.logprobs is not None else None)


def _outputs_in_order(subject: Subject, results: dict[str, object]) -> list[Generated]:
    outputs: list[Generated] = []
    for i in range(len(subject.prompts)):
        out = results[f"req_{i}"]
        if out.error is not None:
            raise RunFailed(f"request {i} failed: {out.error}")
        outputs.append(generated(out))
    return outputs


def run_generate_batch(subject: Subject) -> list[Generated]:
    config = ContinuousBatchingConfig(
        page_size=PAGE_SIZE, max_batch_tokens=STEP_TOKENS, allow_block_sharing=True, return_logprobs=True
    )
    results = subject.model.generate_batch(
        subject.prompts, greedy(), continuous_batching_config=config, progress_bar=False
    )
    return _outputs_in_order(subject, results)


def start_manager(subject: Subject):
    """The manager (the support check runs here, before any request: the refusal point)."""
    config = ContinuousBatchingConfig(
        page_size=PAGE_SIZE,
        max_batch_tokens=STEP_TOKENS,
        num_blocks=SMALL_CACHE_PAGES,
        allow_block_sharing=True,
        return_logprobs=True,
    )
    return subject.model.init_continuous_batching(
        generation_config=greedy(), continuous_batching_config=config
    )


def run_manager(subject: Subject, manager) -> tuple[list[Generated], str]:
    """The outputs, and the stats that show the preemptions and prefix hits happened."""
    try:
        manager.start()
        ids = manager.add_requests(subject.prompts, max_new_tokens=MAX_NEW_TOKENS)
        index = {rid: i for i, rid in enumerate(ids)}
        outputs: list[Generated | None] = [None] * len(ids)
        deadline = time.monotonic() + RESULT_TIMEOUT_S
        while any(o is None for o in outputs):
            if time.monotonic() > deadline:
                raise RunFailed(f"the manager delivered no result for {RESULT_TIMEOUT_S:g} s")
            result = manager.get_result(timeout=0.5)
            if result is None:
                if not manager.is_running():
                    raise RunFailed(
                        f"the manager thread died: {manager.background_thread_status.fatal_error!r}"
                    )
                continue
            if not result.is_finished():
                continue
            if result.error is not None:
                raise RunFailed(f"request {index[result.request_id]} failed: {result.error}")
            outputs[index[result.request_id]] = generated(result)
        stats = manager.stats()
        notes = f"preemptions={stats.preemptions} prefix_hit_tokens={stats.prefix_cache_hit_tokens}"
    finally:
        manager.stop(block=True, timeout=10)
        manager.destroy()
    return outputs, notes


def run_ours(subject: Subject) -> Outcome:
    started = False
    try:
        manager = start_manager(subject)
        started = True
        runs: dict[str, list[Generated]] = {}
        runs["manager"], notes = run_manager(subject, manager)
        runs["generate_batch"] = run_generate_batch(subject)
    except Exception as exc:  # noqa: BLE001  (every failure is classified)
        return judge_error(subject, exc, (NotImplementedError,), started)
    return judge(subject, runs, notes)
