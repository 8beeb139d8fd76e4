"""A request's status: `RequestStatus`, the transitions allowed between its members, and the `finish_reason` of
the statuses that end a request abnormally. Shared by the request record (requests.py) and the output a user
receives (outputs.py)."""

from __future__ import annotations

import enum


class RequestStatus(enum.IntEnum):
    """Ordered so that `status >= FINISHED` means the request is over.

    The members transformers' own `RequestStatus` has carry its values (PENDING=0 ... FAILED=4), so
    the documents' `output.status == RequestStatus.FINISHED` with transformers' enum works and
    `status >= FINISHED` means "over" for both enums. CANCELLED (5) is over too and equals no member
    of theirs. ABORTED (6) is over too: a request in flight across a weight update of a
    `pause(mode="abort")` (docs/manager.md), ended with the tokens it had. EVICTED is internal: it sorts below
    PENDING (never "over") and users never see it, a preempted request reads as PENDING again (see
    `user_visible`).
    """

    EVICTED = -1
    PENDING = 0
    PREFILLING = 1
    DECODING = 2
    FINISHED = 3
    FAILED = 4
    CANCELLED = 5
    ABORTED = 6

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED

    @property
    def user_visible(self) -> RequestStatus:
        """The status a user sees: an evicted request waits to run again, so it is PENDING."""
        return RequestStatus.PENDING if self is RequestStatus.EVICTED else self


_ACTIVE = {RequestStatus.PREFILLING, RequestStatus.DECODING}
_ENDS = {RequestStatus.FINISHED, RequestStatus.FAILED, RequestStatus.CANCELLED, RequestStatus.ABORTED}
_ENDS_UNRUN = {RequestStatus.FAILED, RequestStatus.CANCELLED, RequestStatus.ABORTED}
ALLOWED_TRANSITIONS: dict[RequestStatus, set[RequestStatus]] = {
    RequestStatus.PENDING: _ACTIVE | _ENDS_UNRUN,
    RequestStatus.PREFILLING: _ACTIVE | {RequestStatus.EVICTED} | _ENDS,
    RequestStatus.DECODING: _ACTIVE | {RequestStatus.EVICTED} | _ENDS,
    RequestStatus.EVICTED: _ACTIVE | _ENDS_UNRUN,
    RequestStatus.FINISHED: set(),
    RequestStatus.FAILED: set(),
    RequestStatus.CANCELLED: set(),
    RequestStatus.ABORTED: set(),
}


# `finish_reason` of requests that did not finish normally.
FINISH_REASONS = {
    RequestStatus.FAILED: "error",
    RequestStatus.CANCELLED: "cancelled",
    RequestStatus.ABORTED: "aborted",
}
