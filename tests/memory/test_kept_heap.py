"""memory/kept_heap.py: a CPU run keeps its freed activations' pages for the next step."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading

import pytest
from transformers import GenerationConfig

from tests.support.models import tiny_llama
from transformers_cb import ContinuousBatchingConfig
from transformers_cb.engine.build import build_engine
from transformers_cb.memory import kept_heap as heap_module
from transformers_cb.memory.kept_heap import (
    M_MMAP_THRESHOLD,
    M_TRIM_THRESHOLD,
    MMAP_THRESHOLD_MAX,
    RESTING_TRIM_THRESHOLD,
    RUN_TRIM_THRESHOLD,
    KeptHeap,
    glibc_controls,
    kept_heap,
)


class Recorder:
    def __init__(self, accept: bool = True) -> None:
        self.calls: list[tuple] = []
        self.accept = accept

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append(("mallopt", param, value))
        return int(self.accept)

    def malloc_trim(self, pad: int) -> int:
        self.calls.append(("malloc_trim", pad))
        return 1


RUN_CALLS = [
    ("mallopt", M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX),
    ("mallopt", M_TRIM_THRESHOLD, RUN_TRIM_THRESHOLD),
]
REST_CALLS = [("mallopt", M_TRIM_THRESHOLD, RESTING_TRIM_THRESHOLD), ("malloc_trim", 0)]


def test_overlapping_runs_set_the_thresholds_once_and_the_last_one_out_restores_them() -> None:
    recorder = Recorder()
    heap = KeptHeap(recorder)
    with heap.run():
        assert recorder.calls == RUN_CALLS
        with heap.run():
            assert recorder.calls == RUN_CALLS
        assert recorder.calls == RUN_CALLS  # the outer run still holds the heap
    assert recorder.calls == RUN_CALLS + REST_CALLS and heap.runs == 0
    with heap.run():
        pass
    assert recorder.calls == (RUN_CALLS + REST_CALLS) * 2


def test_a_run_that_raises_still_restores_the_heap() -> None:
    recorder = Recorder()
    heap = KeptHeap(recorder)
    with pytest.raises(RuntimeError), heap.run():
        raise RuntimeError("step failed")
    assert recorder.calls == RUN_CALLS + REST_CALLS and heap.runs == 0


def test_runs_on_threads_balance() -> None:
    recorder = Recorder()
    heap = KeptHeap(recorder)
    inside = threading.Barrier(4)

    def one_run() -> None:
        with heap.run():
            inside.wait(timeout=60)

    threads = [threading.Thread(target=one_run) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert heap.runs == 0
    assert recorder.calls.count(RUN_CALLS[0]) == 1 and recorder.calls.count(REST_CALLS[1]) == 1


def test_a_refused_threshold_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    heap = KeptHeap(Recorder(accept=False))
    for _ in range(2):
        with heap.run():
            pass
    assert sum("refused" in record.message for record in caplog.records) == 1


def test_without_glibc_or_when_disabled_nothing_is_called(monkeypatch: pytest.MonkeyPatch) -> None:
    with KeptHeap(None).run():
        pass
    recorder = Recorder()
    monkeypatch.setattr(heap_module, "_PROCESS_HEAP", KeptHeap(recorder))
    with kept_heap(False):
        pass
    assert recorder.calls == []
    with kept_heap(True):
        pass
    assert recorder.calls == RUN_CALLS + REST_CALLS


def test_the_switch_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(heap_module.ENV_SWITCH, raising=False)
    assert heap_module.enabled_by_env()
    monkeypatch.setenv(heap_module.ENV_SWITCH, "0")
    assert not heap_module.enabled_by_env()


# A step's activations, allocated, touched and freed together, in a fresh process (the thresholds are the
# process's): counted in minor page faults.
STEPS_SCRIPT = textwrap.dedent(
    """
    import json, resource, torch
    from transformers_cb.memory.kept_heap import M_MMAP_THRESHOLD, glibc_controls, kept_heap

    def steps(n):
        counts = []
        for _ in range(n):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            held = [torch.ones(5 << 20) for _ in range(3)] + [torch.ones(1 << 20)]
            del held
            counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        return counts

    # A known starting point: glibc's dynamic rule depends on the process's history; with its initial
    # threshold every large block is its own memory map, faulted in afresh each step.
    glibc_controls().mallopt(M_MMAP_THRESHOLD, 128 << 10)
    plain = steps(4)
    with kept_heap(True):
        kept = steps(8)
    after = steps(4)
    print(json.dumps({"plain": plain, "kept": kept, "after": after}))
    """
)


@pytest.mark.skipif(glibc_controls() is None, reason="glibc's malloc only")
def test_a_run_faults_its_step_memory_in_once_and_gives_it_back_at_its_end() -> None:
    done = subprocess.run(
        [sys.executable, "-c", STEPS_SCRIPT], capture_output=True, text=True, timeout=600, check=True
    )
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    step_pages = 3 * (20 << 20) // 4096  # the three large activations' pages
    # Blocks given back when freed: every step faults them in again.
    assert all(count >= step_pages // 2 for count in counts["plain"]), counts
    # The run keeps them: once its heap has grown to a step's blocks (a step or a few), no step pays for them.
    assert all(count < step_pages // 20 for count in counts["kept"][4:]), counts
    # The run's end trims the heap: the next step faults its blocks in again.
    assert counts["after"][0] >= step_pages // 2, counts


@pytest.mark.parametrize("switch", [None, "0"])
def test_a_cpu_engine_keeps_the_heap_for_its_session_unless_switched_off(
    monkeypatch: pytest.MonkeyPatch, switch: str | None
) -> None:
    if switch is None:
        monkeypatch.delenv(heap_module.ENV_SWITCH, raising=False)
    else:
        monkeypatch.setenv(heap_module.ENV_SWITCH, switch)
    recorder = Recorder()
    heap = KeptHeap(recorder)
    monkeypatch.setattr(heap_module, "_PROCESS_HEAP", heap)
    engine = build_engine(
        tiny_llama(),
        GenerationConfig(max_new_tokens=2, do_sample=False),
        ContinuousBatchingConfig(num_blocks=8),
    )
    assert engine.settings.step_options.keep_heap is (switch is None)
    with engine.session():
        assert heap.runs == (1 if switch is None else 0)
    assert heap.runs == 0
    assert recorder.calls == (RUN_CALLS + REST_CALLS if switch is None else [])
