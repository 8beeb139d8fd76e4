"""The manager thread's torch CPU threads, chosen while it runs: the cores other processes leave idle.

Why not a count fixed at start: torch's OpenMP threads wait for each other at every parallel region, so a
team larger than the idle cores stalls at every op whenever another process takes a core (on two shared
cores, the real model served a 50-request burst 5.7x slower with two threads than with one:
docs/benchmarks.md, "The server under a burst"), while on idle cores the whole team is faster. A server runs
for hours, beside work that comes and goes, so a count read from the load average at start-up is soon wrong
either way. `AdaptiveThreads` measures instead, between steps, every `interval_s`: the busy time of the cores
this process may run on (`/proc/stat`) minus this process's own CPU time is what the others took; the team is
the cores they leave (at least one). It shrinks at once (a team too large is the costly mistake) and grows
only after two windows agree. Where `/proc/stat` cannot be read (not Linux) it never changes the count.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

INTERVAL_S = 2.0  # long enough to average a few steps, short enough to follow other processes' work


@dataclass(frozen=True)
class CpuSample:
    """At `wall` seconds: the busy seconds of the cores this process may use, and its own CPU seconds."""

    wall: float
    busy_s: float
    own_s: float


def allowed_cpus() -> set[int] | None:
    """The CPU ids this process may run on (its affinity mask), or None where it cannot be read."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return None


def read_sample(cpus: set[int] | None = None, stat_path: str = "/proc/stat") -> CpuSample | None:
    """A `CpuSample` now from `/proc/stat` (busy = every field but idle and iowait, per allowed CPU), or None
    where it cannot be read."""
    cpus = allowed_cpus() if cpus is None else cpus
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    try:
        with open(stat_path) as stat:
            lines = stat.readlines()
    except OSError:
        return None
    busy = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or not name[3:].isdigit():
            continue
        if cpus is not None and int(name[3:]) not in cpus:
            continue
        fields = [int(value) for value in rest.split()]
        # user nice system idle iowait irq softirq steal (guest time is already inside user / nice)
        busy += sum(fields[:8]) - fields[3] - fields[4]
    return CpuSample(time.monotonic(), busy / ticks, time.process_time())


def idle_share(cores: int, others_busy: float) -> int:
    """The team for `cores` when other processes keep `others_busy` cores busy: the rest, at least one."""
    return max(1, min(cores, int(cores - others_busy + 0.5)))


class AdaptiveThreads:
    """Sets the calling thread's torch threads to the cores others leave idle; `tick()` between steps.

    Args:
        cores: the most threads it sets (the cores this process may use).
        interval_s: how often it measures.
        read: the sample source (`read_sample`; tests give their own).
        set_threads: what it sets the count with (torch's, on the thread that calls `tick`).
    """

    def __init__(
        self,
        cores: int,
        interval_s: float = INTERVAL_S,
        read: Callable[[], CpuSample | None] = read_sample,
        set_threads: Callable[[int], None] = torch.set_num_threads,
    ) -> None:
        self.cores = max(1, cores)
        self.interval_s = interval_s
        self._read = read
        self._set_threads = set_threads
        self.threads = self.cores  # the count it set last (the manager thread starts with every core)
        self.others_busy: float | None = None  # what the last window measured
        self.changes = 0
        self._last: CpuSample | None = None
        self._grow_votes = 0

    def start(self) -> None:
        """On the manager thread as it starts: every core, and a fresh first window."""
        self.threads = self.cores
        self._set_threads(self.cores)
        self._last = self._read()
        self._grow_votes = 0

    def tick(self) -> None:
        """Measure if a window has passed, and set the count it calls for. Cheap otherwise (one clock read)."""
        last = self._last
        if last is None:
            self._last = self._read()
            return
        if time.monotonic() - last.wall < self.interval_s:
            return
        now = self._read()
        if now is None:
            return
        self._last = now
        elapsed = now.wall - last.wall
        if elapsed <= 0:
            return
        self.others_busy = max(0.0, ((now.busy_s - last.busy_s) - (now.own_s - last.own_s)) / elapsed)
        wanted = idle_share(self.cores, self.others_busy)
        if wanted > self.threads:
            self._grow_votes += 1
            if self._grow_votes < 2:
                return
        self._grow_votes = 0
        if wanted != self.threads:
            logger.info(
                "torch threads %d -> %d: other processes keep %.1f of %d cores busy",
                self.threads,
                wanted,
                self.others_busy,
                self.cores,
            )
            self._set_threads(wanted)
            self.threads = wanted
            self.changes += 1
