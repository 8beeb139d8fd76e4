"""Weight updates: the scheduler's side of a change of the model's weights (docs/manager.md).

Each change is a new weight version (`Scheduler.weight_version`, from 0). `WeightUpdates.weights_changed`
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
mode with it). Torch-free, as the whole room.
"""

from __future__ import annotations

from typing import Literal

from ..requests import Request, RequestStatus
from .scheduler_state import SchedulerState

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


class WeightUpdates(SchedulerState):
    """Mixed into `Scheduler`."""

    weight_version: int

    def weights_changed(self, mode: UpdateMode) -> list[Request]:
        """The model's weights changed (call between two steps): a new version, no page from before kept
        for later hits, the requests in flight treated by `mode` (module docstring). Returns the requests
        it ended (`abort`), already finished."""
        self.weight_version += 1
        version = self.weight_version
        self.pages.weights_changed(version, self.running)
        ended: list[Request] = []
        # Running ones in order, then the waiting ones that hold KV in the host tier or have tokens.
        in_flight = [*self.running, *(r for r in self.waiting if self._started(r))]
        recomputed: list[Request] = []
        for request in in_flight:
            if mode == "abort":
                self.finish(request, RequestStatus.ABORTED, aborted_error(version))
                ended.append(request)
            elif (mode == "recompute" or self._too_stale(request)) and self._recompute(request):
                recomputed.append(request)
        # Back at the head of the queue, in their order: they were running (or waiting) before the others.
        for request in reversed(recomputed):
            self.waiting.appendleft(request)
        return ended

    def drop_all_kv(self) -> None:
        """Every request in flight drops its KV (device pages, host pages, state slot) and runs prompt +
        tokens so far again from its next admission, at the head of the queue in its order; the weight
        version stays. The manager's `release_cache()`: no request may hold KV in tensors about to be freed."""
        in_flight = [*self.running, *(r for r in self.waiting if self._started(r))]
        recomputed = [request for request in in_flight if self._recompute(request)]
        for request in reversed(recomputed):
            self.waiting.appendleft(request)

    def _started(self, request: Request) -> bool:
        """A waiting request in flight: its KV in the host tier, or tokens generated before a preemption."""
        swapped = self.offload is not None and self.offload.is_swapped(request)
        return swapped or bool(request.generated_ids)

    def _too_stale(self, request: Request) -> bool:
        """Its KV would lag more versions behind the weights than its `max_staleness` allows."""
        limit, version = request.max_staleness, request.kv_version
        if limit is None or version is None or not request.num_computed_tokens:
            return False
        return self.weight_version - version > limit

    def _recompute(self, request: Request) -> bool:
        """Drop the request's KV (device pages, host pages, state slot): it runs prompt + tokens so far
        again from its next admission. Returns whether it was running (it left the running list)."""
        if self.offload is not None and self.offload.is_swapped(request):
            self.offload.discard(request)
        self._drop_kv(request)
        if request not in self.running:
            return False
        self._free_pages(request)
        request.num_registered_pages = 0
        request.set_status(RequestStatus.EVICTED)
        self.running.remove(request)
        self._stopped(request)  # its rows go with the next plan's `released`, its draft shadow too
        return True
