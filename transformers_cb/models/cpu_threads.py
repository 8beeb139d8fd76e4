"""How many CPU threads torch runs a command's model with: `--threads`, else `OMP_NUM_THREADS`, else the cores
other processes leave idle: read once from the load average for `generate` (a job that starts and ends), and
measured while it runs for `serve` (it starts with every core; manager/torch_threads/adaptive_threads.py follows the others'
work between steps: a server outlives the load it started under).

torch's default is one thread per core. OpenMP threads spin-wait for each other at every parallel region, so
when other processes hold cores, a thread that is descheduled stalls the rest of its team at every op: on two
busy cores (load average 4) `make run`'s 64 steps on the real model took 71 s with two threads and 7.4 s with
one. With the cores idle, two threads are faster. So a command on the CPU takes the cores that the load average
leaves idle (at least one); an explicit `--threads N` or `OMP_NUM_THREADS` wins.
"""

from __future__ import annotations

import os


def available_cores() -> int:
    """The cores this process may run on (its affinity mask, which containers and `taskset` narrow)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def idle_cores(cores: int | None = None, load: float | None = None) -> int:
    """The cores not taken by other processes over the last minute (load average), at least 1."""
    cores = available_cores() if cores is None else cores
    if load is None:
        try:
            load = os.getloadavg()[0]
        except OSError:  # no load average here: assume idle
            return cores
    return max(1, min(cores, int(cores - load + 0.5)))


def adapts(requested: int | None, device: str) -> bool:
    """Whether the count is the command's to choose: on the CPU, neither `--threads` nor `OMP_NUM_THREADS` given."""
    return requested is None and device.startswith("cpu") and not os.environ.get("OMP_NUM_THREADS")


def cpu_threads(requested: int | None, device: str, adaptive: bool = False) -> int | None:
    """The thread count to set, or None to leave torch's (not on the CPU, or `OMP_NUM_THREADS` set).
    `adaptive`: the count will follow the load while the command runs, so it starts with every core."""
    if requested is not None:
        return requested
    if not adapts(requested, device):
        return None
    return available_cores() if adaptive else idle_cores()
