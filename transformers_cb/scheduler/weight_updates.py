"""Weight updates: the scheduler's side of a change of the model's weights (docs/manager.md).

Each change is a new weight version (`Scheduler.weight_version`, from 0). `Scheduler.weights_changed`
applies one at a step boundary, between two forwards:

- no page computed before may be hit again: every page loses its prefix key, cached or held by a request,
  and the promises of pages still being computed are withdrawn (`PageManager.weights_changed`);
- the requests in flight (running, swapped out to the host tier, or waiting to recompute after generating
  tokens) are treated by the update's mode:

  - `keep`: they continue on their KV (the tokens they produce from now on come from the new weights);
    one whose KV would lag more than its `max_staleness` versions behind recomputes instead;
  - `recompute`: their KV is dropped (never swapped out: it is stale) and they run prompt + tokens so far
    again under the new weights, as a request preempted by recompute does;
  - `abort`: they end at once, `ABORTED`, with the tokens they had.

`UPDATE_MODES` and `check_update_mode` are the modes' one definition (the manager checks its callers'
mode with it); `in_flight` and `too_stale` say which requests an update concerns. Torch-free, as the whole
room.
"""

from __future__ import annotations

from typing import Literal

from ..requests import Request

UpdateMode = Literal["keep", "recompute", "abort"]
UPDATE_MODES: tuple[UpdateMode, ...] = ("keep", "recompute", "abort")


def check_update_mode(mode: object, name: str = "mode") -> UpdateMode:
    """`mode` if it is a weight-update mode, else a `ValueError` naming the modes."""
    if not isinstance(mode, str) or mode not in UPDATE_MODES:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, UPDATE_MODES))}, got {mode!r}")
    return mode


def stronger(first: UpdateMode, second: UpdateMode) -> UpdateMode:
    """The stricter of two modes (keep < recompute < abort): two updates merged into one step boundary."""
    return max(first, second, key=UPDATE_MODES.index)


def aborted_error(version: int) -> str:
    return f"aborted: the model's weights changed (weight version {version}) while the request was in flight"


def in_flight(request: Request, swapped: bool) -> bool:
    """A waiting request in flight: its KV in the host tier (`swapped`), or tokens generated before a
    preemption."""
    return swapped or bool(request.generated_ids)


def too_stale(request: Request, weight_version: int) -> bool:
    """Its KV would lag more versions behind the weights (`weight_version`) than its `max_staleness` allows."""
    limit, version = request.max_staleness, request.kv_version
    if limit is None or version is None or not request.num_computed_tokens:
        return False
    return weight_version - version > limit
