"""Submissions to the manager: `add_request(s)` (validated at once, all or nothing) and `cancel_request`.

Recorded in the shared `ManagerState` under its lock; the loop thread (loop.py) moves them into the
engine at the next step boundary. A submission refused with an exception, or after `stop()`, also drops a result
handler registered for its id in advance.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..engine.engine import Engine
from ..engine.intake.submission import make_submission
from ..engine.intake.validation import per_item
from ..engine.weights.adapter_registry import UNSET
from ..requests import Request
from .delivery.results import ResultRouter
from .loop import ManagerLoop
from .state import ManagerState

logger = logging.getLogger("transformers_cb.manager")  # one logger for the manager's messages


@dataclass(frozen=True)
class SubmissionOptions:
    """What `add_request` / `add_requests` apply to every request of one submission."""

    max_new_tokens: int | None = None
    streaming: bool = False
    eos_token_id: int | list[int] | None = None
    record_timestamps: bool = False
    # The per-request keyword arguments (sampling, speculation, media), sorted at `_build_requests`.
    per_request: dict[str, object] = field(default_factory=dict)
    num_return_sequences: int | None = None  # None: the generation config's
    max_staleness: int | None = None  # weight versions a request's KV may lag behind (None: any)
    # Per-item kwargs over `per_request` (add_requests' per-input `guided`), one per item.
    item_kwargs: tuple[dict[str, object], ...] = ()
    # The PEFT adapter (engine/weights/adapter_registry.py; UNSET: the model's active one), or one per item (a tuple).
    adapter: object = UNSET

    @classmethod
    def of(
        cls,
        max_new_tokens: int | None,
        streaming: bool,
        eos_token_id: int | list[int] | None,
        record_timestamps: bool,
        kwargs: dict[str, Any],
        num_items: int | None = None,
    ) -> SubmissionOptions:
        """`kwargs`: the per-request keyword arguments; all but `num_return_sequences` and `max_staleness`
        are sampling, speculation or media ones (a typed `Submission` each, made in `_build_requests`).
        With `num_items` (add_requests), `kwargs["guided"]` may be a list or tuple of one constraint per
        item (None: unconstrained) instead of one for all (split by `per_item`, as generate_batch's)."""
        kwargs = dict(kwargs)
        forks = kwargs.pop("num_return_sequences", None)
        max_staleness = kwargs.pop("max_staleness", None)
        adapter = kwargs.pop("adapter", UNSET)
        if num_items is not None and isinstance(adapter, (list, tuple)):
            adapter = tuple(per_item(adapter, num_items, "adapter"))
        item_kwargs: tuple[dict[str, object], ...] = ()
        if num_items is not None and "guided" in kwargs:
            item_kwargs = tuple(
                {"guided": value} for value in per_item(kwargs["guided"], num_items, "guided")
            )
            kwargs["guided"] = None  # each item's value replaces it in place (checks keep the caller's order)
        return cls(
            max_new_tokens,
            streaming,
            eos_token_id,
            record_timestamps,
            kwargs,
            forks,
            max_staleness,
            item_kwargs,
            adapter,
        )


class Submissions:
    """Validates and queues submissions and cancellations in the shared state (see the module docstring).

    Args:
        state: the state shared with the loop; the engine's request checks and ids are read through it.
        router: gets a route for each accepted request (and forgets handlers of refused ones).
        loop: tells whether the thread runs, and applies a cancellation at once when it does not.
    """

    def __init__(self, state: ManagerState, router: ResultRouter, loop: ManagerLoop) -> None:
        self._state = state
        self._router = router
        self._loop = loop

    def submit(
        self,
        items: Sequence[tuple[object, str | None]],
        options: SubmissionOptions,
        indexed: bool,
        max_queue_size: int,
    ) -> list[str] | None:
        """Validate every `(input_ids, request_id)` item (all or nothing) and queue them; None after `stop()`.
        `indexed`: name a bad item `inputs[i]` in the error. `max_queue_size`: 0 is unbounded."""
        state = self._state
        with state.lock:
            engine = state.engine
            if engine is None:
                raise RuntimeError("this ContinuousBatchingManager was destroyed")
            if engine.is_follower:
                raise RuntimeError(
                    f"tensor parallelism: submit requests on rank 0; this is rank {engine.rank}, "
                    "which only replays rank 0's steps (start() and stop() it like rank 0's manager)"
                )
            if not state.accepting:
                logger.warning("ContinuousBatchingManager is stopped: %d request(s) refused", len(items))
                self._drop_early_handlers(items)
                return None
            waiting = state.num_waiting()
            if max_queue_size and waiting + len(items) > max_queue_size:
                raise queue.Full(
                    f"max_queue_size={max_queue_size}: {waiting} requests are already waiting, "
                    f"{len(items)} more do not fit"
                )
            try:
                requests = self._build_requests(engine, items, options, indexed)
            except BaseException:
                self._drop_early_handlers(items)
                raise
            for request in requests:
                for member in request.family:
                    state.live[member.request_id] = member
                    self._router.expect(member.request_id, options.streaming)
            state.incoming.extend(engine.admission_order(requests))
            state.lock.notify_all()
        return [request.request_id for request in requests]

    def cancel(self, request_id: str) -> None:
        """Record a cancellation for the next step boundary (at once when the thread does not run)."""
        state = self._state
        with state.lock:
            if request_id not in state.live:
                logger.warning("cancel_request: unknown or already finished request %r", request_id)
                return
            state.cancels.add(request_id)
            state.lock.notify_all()
            if self._loop.is_running():
                return
        # No loop to do it: apply now (the engine is idle, nobody else touches it).
        self._loop.apply_submissions()

    def _build_requests(
        self,
        engine: Engine,
        items: Sequence[tuple[object, str | None]],
        options: SubmissionOptions,
        indexed: bool,
    ) -> list[Request]:
        """Validate every item (all or nothing); the lock is held."""
        requests: list[Request] = []
        taken = set(self._state.live) | self._router.ids_in_use()
        for index, (input_ids, request_id) in enumerate(items):
            label = f"inputs[{index}]" if indexed else None
            if request_id is None:
                request_id = engine.new_request_id(taken)
            elif not isinstance(request_id, str):
                raise ValueError(f"request_id must be a str, got {type(request_id).__name__}")
            elif request_id in taken:
                raise ValueError(
                    f"request_id {request_id!r} is already in use by a request whose outputs are not "
                    "all delivered yet"
                )
            given = (
                {**options.per_request, **options.item_kwargs[index]}
                if options.item_kwargs
                else options.per_request
            )
            media, per_request = engine.build_request.split_media(given)
            submission = make_submission(
                input_ids,
                request_id,
                per_request,
                media,
                max_new_tokens=options.max_new_tokens,
                eos_token_id=options.eos_token_id,
                streaming=options.streaming,
                record_timestamps=options.record_timestamps,
                label=label,
                num_return_sequences=options.num_return_sequences,
                max_staleness=options.max_staleness,
                adapter=options.adapter[index] if isinstance(options.adapter, tuple) else options.adapter,
            )
            requests.append(engine.build_request(submission))
            for member in requests[-1].family:
                if member is not requests[-1] and member.request_id in taken:
                    raise ValueError(f"request_id {member.request_id!r} (a fork of {request_id!r}) is in use")
                taken.add(member.request_id)
        return requests

    def _drop_early_handlers(self, items: Sequence[tuple[object, str | None]]) -> None:
        for _, request_id in items:
            if isinstance(request_id, str):
                self._router.drop_early_handler(request_id)
