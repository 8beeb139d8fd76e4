"""Run torch work in a background thread at the speed of the thread that started it.

Cause (2-core numbers in docs/design.md, "Threads and speed"): torch's CPU ops run on GNU OpenMP, which gives every
OS thread that runs a parallel region its own worker team and keeps it alive, idle, afterwards. A worker thread's
forwards then run next to the main thread's idle team: with the default wait policy libgomp counts more threads than
CPUs and cuts every thread's spin-wait from 300000 to 100 iterations, so threads sleep and wake on a futex at each of
the ~150 parallel regions of a decode step (1.02-1.26x slower); with OMP_WAIT_POLICY=active (or a large
GOMP_SPINCOUNT) the idle team keeps spinning on a core (1.9-2.3x). A bare thread also runs with grad mode on (grad /
inference mode, autocast are thread-local). Fix: `ThreadSettings.capture()` (caller's thread) releases the caller's
idle team (`omp_pause_resource_all`); `apply()` (worker) reproduces the caller's thread-local torch state.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

__all__ = [
    "ThreadSettings",
    "openmp_runtimes",
    "release_openmp_pool",
    "start_worker_thread",
    "worker_thread_context",
]

_OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: omp_pause_soft = 1, omp_pause_hard = 2

# Guards entered by `ThreadSettings.apply()` (inference mode, autocast) that must stay entered for the rest of the
# thread's life. Thread-local, so they are released in their own thread when it ends.
_held = threading.local()

_libgomp_cache: list[ctypes.CDLL] | None = None
_libgomp_lock = threading.Lock()


def _loaded_libgomps() -> list[ctypes.CDLL]:
    """The GNU OpenMP runtimes mapped into this process (Linux only; usually just torch's own copy)."""
    global _libgomp_cache
    with _libgomp_lock:
        if _libgomp_cache is not None:
            return _libgomp_cache
        libs: list[ctypes.CDLL] = []
        paths: set[str] = set()
        if sys.platform.startswith("linux"):
            try:
                with open("/proc/self/maps") as maps:
                    for line in maps:
                        path = line.rstrip("\n").split(maxsplit=5)[-1]
                        if os.path.basename(path).startswith("libgomp") and ".so" in path:
                            paths.add(path)
            except OSError:
                paths = set()
        for path in sorted(paths):
            try:
                # RTLD_NOLOAD: only bind to a copy that is already loaded, never load a new one.
                lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            except OSError:
                continue
            if hasattr(lib, "omp_pause_resource_all"):
                lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
                lib.omp_pause_resource_all.restype = ctypes.c_int
                libs.append(lib)
        _libgomp_cache = libs
        return libs


def openmp_runtimes() -> list[str]:
    """Paths of the libgomp copies `release_openmp_pool` acts on (empty: it is a no-op here)."""
    return [lib._name for lib in _loaded_libgomps()]


def release_openmp_pool() -> bool:
    """Release the *calling* thread's idle OpenMP worker team (libgomp's `omp_pause_resource_all`).

    libgomp keeps one worker team per OS thread that ever ran a parallel region; while two teams exist it counts
    more threads than CPUs and makes every thread sleep on a futex almost at once instead of spinning between
    parallel regions, which slows both threads' torch ops (see the module docstring). Releasing the team of a thread
    that will stay idle (the thread that starts a background worker, or the worker before it waits a long time)
    keeps one team in the process. The next parallel region of this thread recreates its team (a few thread
    creations, tens of microseconds), so this is always safe to call outside a parallel region.

    Only acts on GNU OpenMP (torch's Linux wheels); a no-op returning False elsewhere (LLVM/Intel OpenMP pause the
    whole runtime, not one thread's team). Returns True if a team was released (or there was none to release).

    Trade-off: with a single team, libgomp's default spin-waiting is what the main thread gets too; it is fastest on
    idle cores but several times slower when other processes compete for the cores (measured 6-50x on 2 busy cores,
    against the throttled waiting that a second team triggers). Processes on shared cores are better served by
    OMP_WAIT_POLICY=passive or fewer torch threads, set before torch is imported.
    """
    libs = _loaded_libgomps()
    return bool(libs) and all(lib.omp_pause_resource_all(_OMP_PAUSE_SOFT) == 0 for lib in libs)


def _flush_denormal_enabled() -> bool:
    """Whether this thread flushes denormals (FTZ/DAZ are per-thread CPU flags, set by `torch.set_flush_denormal`)."""
    with torch.inference_mode():
        tiny = torch.full((1,), 1e-40, dtype=torch.float32)  # a float32 denormal
        return bool((tiny * 1.0).item() == 0.0)


def _affinity() -> frozenset[int] | None:
    getter = getattr(os, "sched_getaffinity", None)
    if getter is None:
        return None
    try:
        return frozenset(getter(0))  # 0: the calling thread on Linux
    except OSError:
        return None


@dataclass(frozen=True)
class ThreadSettings:
    """The thread-local torch state of one thread, to reproduce in another.

    Capture it in the thread that starts a worker (`capture()`), then call `apply()` first thing in the worker, or
    run the worker's body under `worker_thread_context(settings)`.
    """

    #: torch intra-op threads (`torch.get_num_threads()`; the OpenMP nthreads ICV is per thread).
    num_threads: int
    #: `torch.is_grad_enabled()` (thread-local).
    grad_enabled: bool
    #: `torch.is_inference_mode_enabled()` (thread-local).
    inference_mode: bool
    #: FTZ/DAZ flags (`torch.set_flush_denormal`, per-thread CPU state).
    flush_denormal: bool
    #: `torch.is_autocast_enabled("cpu")` and its dtype (thread-local).
    autocast_cpu: bool
    autocast_cpu_dtype: torch.dtype
    #: CPU affinity of the thread (`os.sched_getaffinity(0)`), None where unsupported.
    affinity: frozenset[int] | None

    @classmethod
    def capture(cls, *, release_pool: bool = True) -> ThreadSettings:
        """Capture the calling thread's settings. Call it in the thread that starts the worker.

        With `release_pool` (default) it also releases the calling thread's idle OpenMP team, on the
        assumption that the caller hands its torch work to the worker (see `release_openmp_pool()`), so the worker
        runs exactly like the main thread would. A later parallel region in the caller recreates the team; call
        `release_openmp_pool()` again once it is idle. `release_pool=False` keeps the second team, hence libgomp's
        throttled (sleep-at-once) waiting for the whole process: 2-26% slower on idle cores, but several times
        faster when other processes compete for the cores (spinning threads then wait for descheduled teammates).
        """
        settings = cls(
            num_threads=torch.get_num_threads(),
            grad_enabled=torch.is_grad_enabled(),
            inference_mode=torch.is_inference_mode_enabled(),
            flush_denormal=_flush_denormal_enabled(),
            autocast_cpu=torch.is_autocast_enabled("cpu"),
            autocast_cpu_dtype=torch.get_autocast_dtype("cpu"),
            affinity=_affinity(),
        )
        if release_pool:
            release_openmp_pool()
        return settings

    def apply(self) -> None:
        """Reproduce the settings in the calling thread, for the rest of its life. Call it first thing in the worker.

        Thread-wide state is set directly; inference mode and CPU autocast, which torch only offers as scoped
        guards, are entered here and stay entered until the thread ends (or until `apply()` is called again in the
        same thread). Use `worker_thread_context` for a scoped version.
        """
        self._apply_thread_wide()
        previous: contextlib.ExitStack | None = getattr(_held, "stack", None)
        if previous is not None:
            _held.stack = None
            previous.close()
        stack = contextlib.ExitStack()
        self._enter_scoped(stack, inference_mode=self.inference_mode)
        _held.stack = stack

    # -- internals -----------------------------------------------------------------------------------------------
    def _apply_thread_wide(self) -> None:
        if torch.get_num_threads() != self.num_threads:
            torch.set_num_threads(self.num_threads)
        torch.set_grad_enabled(self.grad_enabled)
        if _flush_denormal_enabled() != self.flush_denormal:
            torch.set_flush_denormal(self.flush_denormal)
        if self.affinity is not None and _affinity() != self.affinity:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, self.affinity)

    def _enter_scoped(self, stack: contextlib.ExitStack, *, inference_mode: bool) -> None:
        if inference_mode:
            stack.enter_context(torch.inference_mode())
        if self.autocast_cpu:
            stack.enter_context(torch.autocast("cpu", dtype=self.autocast_cpu_dtype))


@contextlib.contextmanager
def worker_thread_context(
    settings: ThreadSettings | None = None, *, inference_mode: bool | None = True
) -> Iterator[ThreadSettings]:
    """Run a worker thread's body with `settings` applied; scoped guards are exited on leaving.

    `settings` defaults to the current thread's (`capture(release_pool=False)`). `inference_mode=True`
    (default) enters `torch.inference_mode()` whatever the captured mode, False leaves it off, None follows the
    captured mode. The worker's OpenMP team is released on leaving, since the thread is about to end or go idle.
    """
    if settings is None:
        settings = ThreadSettings.capture(release_pool=False)
    settings._apply_thread_wide()
    try:
        with contextlib.ExitStack() as stack:
            settings._enter_scoped(
                stack, inference_mode=settings.inference_mode if inference_mode is None else inference_mode
            )
            yield settings
    finally:
        release_openmp_pool()


def start_worker_thread(
    target: Callable[..., object],
    *args: object,
    name: str | None = None,
    daemon: bool = True,
    inference_mode: bool | None = True,
    **kwargs: object,
) -> threading.Thread:
    """Start `target(*args, **kwargs)` in a new thread that runs at the caller's speed.

    Captures the caller's `ThreadSettings` (releasing its idle OpenMP team) and runs `target` under
    `worker_thread_context(settings, inference_mode=inference_mode)`.
    """
    settings = ThreadSettings.capture()

    def run() -> None:
        with worker_thread_context(settings, inference_mode=inference_mode):
            target(*args, **kwargs)

    thread = threading.Thread(target=run, name=name, daemon=daemon)
    thread.start()
    return thread
