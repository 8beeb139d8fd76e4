"""`WeightWatch` (`Engine.check_weights`): whether the model's weights changed since the last look, and a
change applied: a new weight version in the scheduler (its prefix keys dropped, the requests in flight kept,
recomputed or aborted: scheduler/weight_updates.py), the packed copies dropped, the adapters scanned again,
and the requests that chose their adapter failed when adapters can no longer run per request.

Its own part so that the engine's step does not carry the watch's state (the last fingerprint, why adapters
cannot mix since the last change).
"""

from __future__ import annotations

import logging

from transformers import PreTrainedModel

from ...memory.weight_key import weights_fingerprint
from ...requests import Request, RequestStatus
from ...runner.products.packed_model import release_packs
from ...scheduler.scheduler import Scheduler
from ...scheduler.weight_updates import UpdateMode
from .adapter_registry import AdapterRegistry

logger = logging.getLogger(__name__)


class WeightWatch:
    """Args: the engine's `model`, `scheduler` and `adapters` (None: no PEFT adapters). The requests a change
    ends are the engine's to tell the other tensor-parallel ranks (`Engine.check_weights`)."""

    def __init__(
        self,
        model: PreTrainedModel,
        scheduler: Scheduler,
        adapters: AdapterRegistry | None,
    ) -> None:
        self.model = model
        self.scheduler = scheduler
        self.adapters = adapters
        self.weights = weights_fingerprint(model)  # the fingerprint of the last look
        self.unmixable: str | None = None  # why adapters cannot run per request since the last change

    def check(self, mode: UpdateMode, changed: bool) -> list[Request] | None:
        """A change of the weights applied, if there was one: `changed` (the caller knows: a write through
        `.data`, `load_state_dict(assign=True)`, an optimizer writing through views, none of which bumps a
        version counter) or the weights' fingerprint differs from the last one seen (in-place writes bump
        a parameter's version counter; a new tensor changes its address).

        A change is a new weight version: no page computed before may be hit again, and the requests in
        flight are kept, recomputed or aborted by `mode` (scheduler/weight_updates.py); the packed copies
        of the weights are dropped when the change bumped no counter. Returns the requests it ended
        (`abort`; already finished), or None when nothing changed."""
        weights = weights_fingerprint(self.model)
        if not changed and weights == self.weights:
            return None
        self.weights = weights
        if self.adapters is not None:
            self.adapters.refresh()  # adapters added, deleted or loaded since: scanned again
        if changed:
            release_packs(self.model)  # a pack is rebuilt only when its weight's key changed
        ended = self.scheduler.weights_changed(mode) + self._fail_unmixable()
        logger.info("model weights changed: weight version %d (%s)", self.scheduler.weight_version, mode)
        return ended

    def _fail_unmixable(self) -> list[Request]:
        """After a weight change: if adapters can no longer be applied per request (one merged, another
        method made active: engine/weights/adapter_registry.py), every request in flight that chose its adapter
        fails with the reason instead of running with that change applied to its rows too (and so do those
        submitted before it and handed over after it: `adapter_refusal`)."""
        self.unmixable = self.adapters.mixing_problem() if self.adapters is not None else None
        failed = [r for r in [*self.scheduler.running, *self.scheduler.waiting] if self.adapter_refusal(r)]
        for request in failed:
            self.scheduler.finish(request, RequestStatus.FAILED, self.adapter_refusal(request))
        return failed

    def adapter_refusal(self, request: Request) -> str | None:
        """Why `request`, which chose its adapter, cannot run after the last weight change, or None."""
        if request.adapter is None or self.unmixable is None:
            return None
        return f"its adapter can no longer be applied per request: {self.unmixable}"
