"""The manager thread's torch threads follow the cores other processes leave idle (manager/torch_threads/adaptive_threads.py):
measured between steps from the cores' busy time minus the process's own, shrunk at once, grown after two
windows agree, set on the manager thread itself."""

from __future__ import annotations

import threading

from tests.support.manager import CB_CONFIG, PROMPTS, make_model
from tests.support.threads import TIMEOUT
from transformers_cb import ContinuousBatchingConfig, ContinuousBatchingManager
from transformers_cb.manager.loop import THREAD_NAME
from transformers_cb.manager.torch_threads.adaptive_threads import (
    AdaptiveThreads,
    CpuSample,
    idle_share,
    read_sample,
)


class Clockwork:
    """Samples whose windows say how busy the other processes kept the cores (`others` per window)."""

    def __init__(self) -> None:
        self.wall = self.busy = self.own = 0.0
        self.others = 0.0
        self.mine = 1.0  # cores this process keeps busy

    def advance(self, seconds: float) -> None:
        self.wall += seconds
        self.busy += (self.others + self.mine) * seconds
        self.own += self.mine * seconds

    def read(self) -> CpuSample:
        return CpuSample(self.wall, self.busy, self.own)


def tuner(cores: int, clock: Clockwork, monkeypatch, sets: list[int]) -> AdaptiveThreads:
    from transformers_cb.manager.torch_threads import adaptive_threads

    monkeypatch.setattr(adaptive_threads.time, "monotonic", lambda: clock.wall)
    threads = AdaptiveThreads(cores, interval_s=2.0, read=clock.read, set_threads=sets.append)
    threads.start()
    return threads


def test_idle_share_rounds_to_the_nearest_core_and_keeps_one() -> None:
    assert [idle_share(2, busy) for busy in (0.0, 0.4, 0.6, 1.0, 1.9, 3.5)] == [2, 2, 1, 1, 1, 1]
    assert idle_share(8, 3.2) == 5


def test_it_shrinks_at_once_and_grows_after_two_windows(monkeypatch) -> None:
    clock, sets = Clockwork(), []
    threads = tuner(4, clock, monkeypatch, sets)
    assert sets == [4] and threads.threads == 4  # every core to begin with
    clock.others = 2.2
    clock.advance(1.0)
    threads.tick()
    assert sets == [4]  # not a whole window yet: nothing measured
    clock.advance(1.5)
    threads.tick()
    assert threads.others_busy is not None and abs(threads.others_busy - 2.2) < 1e-9
    assert sets == [4, 2] and threads.threads == 2  # 4 - 2.2 -> 2, at once
    clock.others = 0.0
    clock.advance(2.0)
    threads.tick()
    assert sets == [4, 2]  # one window of idle cores is not enough to grow
    clock.advance(2.0)
    threads.tick()
    assert sets == [4, 2, 4] and threads.changes == 2


def test_its_own_work_is_not_counted_as_the_others(monkeypatch) -> None:
    clock, sets = Clockwork(), []
    threads = tuner(2, clock, monkeypatch, sets)
    clock.mine = 2.0  # this process alone keeps both cores busy
    for _ in range(3):
        clock.advance(2.0)
        threads.tick()
    assert sets == [2] and threads.threads == 2


def test_without_a_sample_it_never_changes_the_count(monkeypatch) -> None:
    sets: list[int] = []
    threads = AdaptiveThreads(2, interval_s=0.0, read=lambda: None, set_threads=sets.append)
    threads.start()
    for _ in range(3):
        threads.tick()
    assert sets == [2] and threads.changes == 0


def test_a_sample_from_proc_stat(tmp_path) -> None:
    stat = tmp_path / "stat"
    stat.write_text(
        "cpu  10 0 10 100 5 0 0 0 0 0\n"
        "cpu0 100 0 50 1000 20 1 2 3 0 0\n"
        "cpu1 200 0 100 1000 20 0 0 0 0 0\n"
        "intr 1 2 3\n"
    )
    sample = read_sample({0}, str(stat))
    assert sample is not None
    import os

    assert abs(sample.busy_s - 156 / os.sysconf("SC_CLK_TCK")) < 1e-9  # cpu0 only: all but idle and iowait
    both = read_sample({0, 1}, str(stat))
    assert both is not None and both.busy_s > sample.busy_s
    assert read_sample({0}, str(tmp_path / "missing")) is None
    live = read_sample()
    assert live is None or live.busy_s > 0


def test_the_manager_thread_sets_its_own_count_between_steps() -> None:
    calls: list[tuple[str, int]] = []
    samples = iter(CpuSample(float(i) * 10, float(i) * 10 * 5, 0.0) for i in range(10_000))

    def record(count: int) -> None:
        calls.append((threading.current_thread().name, count))

    # Others keep 5 cores busy in every window: the count drops to 1 on the first window.
    threads = AdaptiveThreads(3, interval_s=0.0, read=lambda: next(samples), set_threads=record)
    model = make_model()
    manager = ContinuousBatchingManager(
        model, continuous_batching_config=ContinuousBatchingConfig(**CB_CONFIG), adaptive_threads=threads
    )
    manager.start()
    try:
        request_id = manager.add_request(PROMPTS[0], max_new_tokens=4)
        assert manager.get_result(request_id, timeout=TIMEOUT) is not None
    finally:
        manager.stop(timeout=TIMEOUT)
        manager.destroy()
    assert calls[:2] == [(THREAD_NAME, 3), (THREAD_NAME, 1)]
    assert all(name == THREAD_NAME for name, _ in calls)
