"""Running entries in forked worker processes, each under a deadline.

The parent imports torch, transformers and the package once; each entry runs in a process forked from it
(cheap, and isolated: a hang, a segfault or a leaked thread ends with that process). The child sends its
results through a pipe as they come (the row's description, ours, ours sharp, then the built-in's), so a
built-in that hangs does not lose our outcome. Ours and ours sharp each have the `timeout` deadline, the rest
the built-in's. Past the deadline the child is killed and what is missing is a crash.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

from .catalog import Entry
from .outcome import CRASH, NOT_INSTANTIABLE, Outcome, Row, one_line


@dataclass
class Job:
    entry: Entry
    process: multiprocessing.Process
    conn: Connection
    started: float
    deadline: float
    row: Row
    ours_done: bool = False
    sharp: float | None = None  # the sharp column's factor (None: not asked)
    sharp_done: bool = False
    timeout: float = 0.0
    done: bool = False
    tool_error: str | None = None


def _silence() -> None:
    """Children write nothing to the terminal: the built-in and the classes log freely."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)


def _child(
    entry: Entry, conn: Connection, builtin: bool, quiet: bool, media: bool, sharp: float | None
) -> None:
    import logging
    import warnings

    import torch
    import transformers

    if quiet:
        _silence()
    warnings.filterwarnings("ignore")
    logging.disable(logging.CRITICAL)
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)

    try:
        _probe(entry, conn, builtin, media, sharp)
    except Exception as exc:  # noqa: BLE001  (a bug of the tool itself: reported as the row's reason)
        conn.send(("tool-error", f"coverage tool error: {type(exc).__name__}: {exc}"))
    conn.send(("done", None))


def _probe(entry: Entry, conn: Connection, builtin: bool, media: bool, sharp: float | None) -> None:
    from .build import NotBuilt, build_subject, describe_unbuilt
    from .ours import run_ours

    try:
        subject = build_subject(entry)
    except NotBuilt as exc:
        conn.send(("info", describe_unbuilt(entry)))
        outcome = Outcome(NOT_INSTANTIABLE, one_line(str(exc)))
        conn.send(("ours", outcome))
        if sharp is not None:
            conn.send(("sharp", Outcome(NOT_INSTANTIABLE, outcome.reason, "as unscaled")))
        if builtin:  # no model, no peer run either: the same row in its column
            conn.send(("builtin", outcome))
        return
    conn.send(("info", (subject.family, subject.layer_kinds)))
    ours = run_ours(subject)
    conn.send(("ours", ours))
    if sharp is not None:
        from .sharp import sharp_outcome

        conn.send(("sharp", sharp_outcome(entry, ours, sharp)))
    if media:
        from .media import media_outcome

        conn.send(("media", media_outcome(entry, subject.model, ours)))
    if builtin:
        from .builtin import run_builtin

        start = time.perf_counter()
        outcome = run_builtin(subject)
        outcome.notes = f"{outcome.notes} {time.perf_counter() - start:.1f}s".strip()
        conn.send(("builtin", outcome))


def _start(entry: Entry, builtin: bool, timeout: float, quiet: bool, media: bool, sharp: float | None) -> Job:
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    process = ctx.Process(
        target=_child, args=(entry, child, builtin, quiet, media, sharp), name=f"coverage-{entry.name}"
    )
    process.start()
    child.close()
    now = time.monotonic()
    row = Row(entry.name, entry.model_type, entry.mapping)
    row.ours = Outcome(CRASH, "no result")
    return Job(entry, process, parent, now, now + timeout, row, sharp=sharp, timeout=timeout)


def _receive(job: Job, builtin_timeout: float) -> None:
    kind, payload = job.conn.recv()
    if kind == "info":
        job.row.family, job.row.layer_kinds = payload
    elif kind == "ours":
        job.row.ours = payload
        job.row.seconds = round(time.monotonic() - job.started, 1)
        job.deadline = time.monotonic() + (builtin_timeout if job.sharp is None else job.timeout)
        job.ours_done = True
    elif kind == "sharp":
        job.row.sharp = payload
        job.deadline = time.monotonic() + builtin_timeout
        job.sharp_done = True
    elif kind == "builtin":
        job.row.builtin = payload
    elif kind == "media":
        job.row.media = payload
    elif kind == "tool-error":
        job.tool_error = payload
    elif kind == "done":
        job.done = True


def _finish(job: Job, builtin: bool, why: str | None) -> None:
    """Close a job; `why` says how it ended early (a kill, a dead process)."""
    if job.process.is_alive():
        job.process.kill()
    job.process.join()
    job.conn.close()
    if why is None:
        return
    if not job.ours_done:
        job.row.ours = Outcome(CRASH, why)
        job.row.seconds = round(time.monotonic() - job.started, 1)
    if job.sharp is not None and not job.sharp_done:
        job.row.sharp = Outcome(CRASH, why)
    elif builtin and job.row.builtin is None:
        job.row.builtin = Outcome(CRASH, why)


def run_all(
    entries: list[Entry],
    jobs: int,
    timeout: float,
    builtin_timeout: float,
    builtin: bool = True,
    quiet: bool = True,
    progress: Callable[[int, int, Row], None] | None = None,
    media: bool = False,
    sharp: float | None = None,
) -> list[Row]:
    """Run every entry, `jobs` at a time; rows in the entries' order. `sharp`: the sharp column at that
    factor (after ours, its own `timeout`); `media`: the media column too (after them, within the
    built-in's deadline)."""
    queue = deque(entries)
    running: dict[Connection, Job] = {}
    rows: dict[str, Row] = {}
    while queue or running:
        while queue and len(running) < jobs:
            job = _start(queue.popleft(), builtin, timeout, quiet, media, sharp)
            running[job.conn] = job
        ready = wait(list(running), timeout=0.5)
        for conn in ready:
            job = running[conn]
            why = None
            try:
                _receive(job, builtin_timeout)
            except (EOFError, OSError):
                job.process.join(timeout=5)
                why = f"worker process died (exit code {job.process.exitcode})"
            if job.done or why is not None:
                _finish(job, builtin, why or job.tool_error)
                del running[conn]
                rows[job.entry.name] = job.row
                if progress is not None:
                    progress(len(rows), len(entries), job.row)
        now = time.monotonic()
        for conn, job in list(running.items()):
            if now > job.deadline:
                phase = (
                    "ours"
                    if not job.ours_done
                    else "sharp"
                    if job.sharp is not None and not job.sharp_done
                    else "built-in"
                )
                limit = builtin_timeout if phase == "built-in" else timeout
                _finish(job, builtin, f"hang: no result within {limit:g} s ({phase})")
                del running[conn]
                rows[job.entry.name] = job.row
                if progress is not None:
                    progress(len(rows), len(entries), job.row)
    sys.stdout.flush()
    return [rows[e.name] for e in entries]
