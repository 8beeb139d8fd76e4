"""The host heap during a CPU run: freed step activations stay mapped for the next step.

A CPU step allocates its activations afresh through torch's allocator, which is glibc's `malloc`. glibc gives
memory at the top of its heap back to the kernel once more than its trim threshold is free there (its dynamic
rule sets that at twice the largest block freed so far), so a step's activations, freed together at its end,
are given back, and the next step faults every page in again, each zeroed by the kernel: 135,000 faults a run
of the small benchmark model's shared-prefix workload at 1.8 us each, about 0.25 s of its 3.5 (vLLM's CPU
guide preloads tcmalloc for the same cost). For a run, the trim threshold is raised above any step's
activations and blocks up to glibc's largest mmap threshold come from the heap: the pages faulted by the first
steps serve the rest (28,000 faults a run, its first steps'). On the last run's end the trim threshold is put
back where the dynamic rule leaves it, and the heap is trimmed once, so what a run kept goes back then. The
mmap threshold stays at glibc's largest value, where the dynamic rule also ends after the first large block is
freed.

Only where the C library is glibc (`mallopt` and `malloc_trim` are glibc's); elsewhere, or with
`TRANSFORMERS_CB_KEEP_HEAP=0`, nothing changes. The KV cache does not come from this heap (memory/zeroed.py).
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

logger = logging.getLogger(__name__)

ENV_SWITCH = "TRANSFORMERS_CB_KEEP_HEAP"

# glibc's mallopt parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit hosts: mallopt refuses a larger mmap threshold.
MMAP_THRESHOLD_MAX = 32 << 20
# During a run: above any step's activations (mallopt takes a C int).
RUN_TRIM_THRESHOLD = 1 << 30
# After the last run: where glibc's dynamic rule puts it once a block at the mmap threshold is freed.
RESTING_TRIM_THRESHOLD = 2 * MMAP_THRESHOLD_MAX


class HeapControls(Protocol):
    """The two glibc calls this module makes (`ctypes.CDLL(None)` on glibc; a recorder in tests)."""

    def mallopt(self, param: int, value: int) -> int: ...

    def malloc_trim(self, pad: int) -> int: ...


def enabled_by_env() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0"


def glibc_controls() -> HeapControls | None:
    """The process's glibc, or None where the C library is another one (musl, macOS) or lacks the calls."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
    except (OSError, AttributeError):
        return None
    return libc


@dataclass
class KeptHeap:
    """The runs keeping the heap now (runs overlap: two engines in one process); the first sets the
    thresholds, the last one out restores them."""

    controls: HeapControls | None
    runs: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    warned: bool = False

    @contextmanager
    def run(self) -> Iterator[None]:
        self._enter()
        try:
            yield
        finally:
            self._exit()

    def _enter(self) -> None:
        with self.lock:
            self.runs += 1
            if self.runs == 1 and self.controls is not None:
                set_mmap = self.controls.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)
                set_trim = self.controls.mallopt(M_TRIM_THRESHOLD, RUN_TRIM_THRESHOLD)
                if not (set_mmap and set_trim) and not self.warned:
                    self.warned = True
                    logger.warning(
                        "glibc refused the run's heap thresholds; steps fault their memory in afresh"
                    )

    def _exit(self) -> None:
        with self.lock:
            self.runs -= 1
            if self.runs == 0 and self.controls is not None:
                self.controls.mallopt(M_TRIM_THRESHOLD, RESTING_TRIM_THRESHOLD)
                self.controls.malloc_trim(0)


_PROCESS_HEAP: KeptHeap | None = None
_PROCESS_LOCK = threading.Lock()


def process_heap() -> KeptHeap:
    global _PROCESS_HEAP
    with _PROCESS_LOCK:
        if _PROCESS_HEAP is None:
            _PROCESS_HEAP = KeptHeap(glibc_controls())
        return _PROCESS_HEAP


@contextmanager
def kept_heap(enabled: bool) -> Iterator[None]:
    """The host heap kept for one run (a CPU engine's session); a no-op when not `enabled`."""
    if not enabled:
        yield
        return
    with process_heap().run():
        yield
