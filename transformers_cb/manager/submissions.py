"""Submissions to the manager: `add_request(s)` (validated at once, all or nothing) and `cancel_request`.

Recorded under the manager's lock; the loop thread (manager_loop.py) moves them into the engine at
the next step boundary. A submission refused with an exception, or after `stop()`, also drops a result
handler registered for its id in advance.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..requests import Request
from .loop import ManagerLoop

logger = logging.getLogger("transformers_cb.manager")  # one logger for the manager's messages


@dataclass(frozen=True)
class SubmissionOptions:
    """What `add_request` / `add_requests` apply to every request of one submission."""

    max_new_tokens: int | None = None
    streaming: bool = False
    eos_token_id: int | list[int] | None = None
    record_timestamps: bool = False
    sampling_kwargs: dict[str, Any] = field(default_factory=dict)
    num_return_sequences: int | None = None  # None: the generation config's

    @classmethod
    def of(
        cls,
        max_new_tokens: int | None,
        streaming: bool,
        eos_token_id: int | list[int] | None,
        record_timestamps: bool,
        kwargs: dict[str, Any],
    ) -> SubmissionOptions:
        """`kwargs`: the per-request keyword arguments; all but `num_return_sequences` are sampling ones."""
        kwargs = dict(kwargs)
        forks = kwargs.pop("num_return_sequences", None)
        return cls(max_new_tokens, streaming, eos_token_id, record_timestamps, kwargs, forks)


class ManagerSubmissions(ManagerLoop):
    """The submission half of `ContinuousBatchingManager` (see manager.py)."""

    max_queue_size: int

    def add_request(
        self,
        input_ids: Sequence[int] | torch.Tensor,
        request_id: str | None = None,
        max_new_tokens: int | None = None,
        streaming: bool = False,
        record_timestamps: bool = False,
        eos_token_id: int | list[int] | None = None,
        **logit_processor_kwargs: Any,
    ) -> str | None:
        """Submit one request and return its id, or None (with a warning) after `stop()`.

        `record_timestamps` gives the outputs `timestamps` (one `time.perf_counter()` per token);
        `logit_processor_kwargs` are per-request sampling parameters and outputs (`temperature`,
        `top_k`, `top_p`, `min_p`, `repetition_penalty`, `seed`, `stop_strings`, `top_logprobs`,
        `prompt_logprobs`; docs/sampling.md), and `num_return_sequences` (default: the generation
        config's): n > 1 also gives results for the siblings `f"{request_id}__child#{i}"`,
        i < n - 1, which share the prompt's KV pages (docs/prefix_sharing.md).

        Raises:
            ValueError: bad input (empty prompt, token outside the vocabulary, `max_new_tokens <= 0`,
                too long for the model or the whole cache, a bad per-request parameter) or a
                duplicate live `request_id`.
            queue.Full: `max_queue_size` requests are already waiting to be scheduled.
            RuntimeError: the manager was destroyed.
        """
        options = SubmissionOptions.of(
            max_new_tokens, streaming, eos_token_id, record_timestamps, logit_processor_kwargs
        )
        ids = self._submit([(input_ids, request_id)], options, indexed=False)
        return None if ids is None else ids[0]

    def add_requests(
        self,
        inputs: Sequence[Sequence[int]],
        max_new_tokens: int | None = None,
        streaming: bool = False,
        record_timestamps: bool = False,
        eos_token_id: int | list[int] | None = None,
        **logit_processor_kwargs: Any,
    ) -> list[str] | None:
        """Submit many requests at once and return their ids in input order, or None (with a
        warning) after `stop()`. All or nothing: if any input is invalid (`ValueError` naming
        `inputs[i]`), none is submitted. Other arguments as in `add_request`.

        With prefix sharing on (`allow_block_sharing`), the requests reach the scheduler sorted by
        prompt, so that prompts sharing a prefix run one after the other and hit the prefix cache;
        ids are still given in input order."""
        items = [(input_ids, None) for input_ids in inputs]
        options = SubmissionOptions.of(
            max_new_tokens, streaming, eos_token_id, record_timestamps, logit_processor_kwargs
        )
        return self._submit(items, options, indexed=True)

    def _submit(
        self, items: list[tuple[Any, str | None]], options: SubmissionOptions, indexed: bool
    ) -> list[str] | None:
        with self._lock:
            if self.engine is None:
                raise RuntimeError("this ContinuousBatchingManager was destroyed")
            if self.engine.is_follower:
                raise RuntimeError(
                    f"tensor parallelism: submit requests on rank 0; this is rank {self.engine.tp.rank}, "
                    "which only replays rank 0's steps (start() and stop() it like rank 0's manager)"
                )
            if not self._accepting:
                logger.warning("ContinuousBatchingManager is stopped: %d request(s) refused", len(items))
                self._drop_early_handlers(items)
                return None
            waiting = len(self._incoming) + self._num_engine_waiting()
            if self.max_queue_size and waiting + len(items) > self.max_queue_size:
                raise queue.Full(
                    f"max_queue_size={self.max_queue_size}: {waiting} requests are already waiting, "
                    f"{len(items)} more do not fit"
                )
            try:
                requests = self._build_requests(items, options, indexed)
            except BaseException:
                self._drop_early_handlers(items)
                raise
            for request in requests:
                for member in request.family:
                    self._live[member.request_id] = member
                    self._router.expect(member.request_id, options.streaming)
            self._incoming.extend(self.engine.admission_order(requests))
            self._lock.notify_all()
        return [request.request_id for request in requests]

    def _build_requests(
        self, items: list[tuple[Any, str | None]], options: SubmissionOptions, indexed: bool
    ) -> list[Request]:
        """Validate every item (all or nothing); the lock is held."""
        requests: list[Request] = []
        taken = set(self._live) | self._router.ids_in_use()
        for index, (input_ids, request_id) in enumerate(items):
            label = f"inputs[{index}]" if indexed else None
            if request_id is None:
                request_id = self.engine.new_request_id(taken)
            elif not isinstance(request_id, str):
                raise ValueError(f"request_id must be a str, got {type(request_id).__name__}")
            elif request_id in taken:
                raise ValueError(
                    f"request_id {request_id!r} is already in use by a request whose outputs are not "
                    "all delivered yet"
                )
            requests.append(
                self.engine.build_request(
                    input_ids,
                    request_id,
                    options.max_new_tokens,
                    options.eos_token_id,
                    options.streaming,
                    label=label,
                    record_timestamps=options.record_timestamps,
                    sampling_kwargs=options.sampling_kwargs,
                    num_return_sequences=options.num_return_sequences,
                )
            )
            for member in requests[-1].family:
                if member is not requests[-1] and member.request_id in taken:
                    raise ValueError(f"request_id {member.request_id!r} (a fork of {request_id!r}) is in use")
                taken.add(member.request_id)
        return requests

    def _drop_early_handlers(self, items: list[tuple[Any, str | None]]) -> None:
        for _, request_id in items:
            if isinstance(request_id, str):
                self._router.drop_early_handler(request_id)

    def cancel_request(self, request_id: str) -> None:
        """Cancel a pending or running request: its pages are freed at the next step boundary and
        it receives one final result with status CANCELLED. Unknown ids only log a warning."""
        with self._lock:
            if request_id not in self._live:
                logger.warning("cancel_request: unknown or already finished request %r", request_id)
                return
            self._cancels.add(request_id)
            self._lock.notify_all()
            if self.is_running():
                return
        # No loop to do it: apply now (the engine is idle, nobody else touches it).
        self._apply_submissions()

    def _num_engine_waiting(self) -> int:
        return len(self.engine.scheduler.waiting) if self.engine else 0
