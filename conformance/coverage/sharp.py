"""The sharp column: each entry run a second time with its query / key projections scaled after init.

A tiny random model attends almost uniformly, so a wrong position, rotary frequency, mask or cached key
can leave its greedy tokens unchanged. The sharp column rebuilds the entry's model with the same seed,
scales every query and key projection by `SHARP_FACTOR` (tests/support/sharp.py: attention logits grow by
its square), takes new `generate()` references and judges ours exactly as the plain column (the manager
with preemptions, then `generate_batch`). An entry refused or not instantiable unscaled keeps that state
(the support check reads the config and the classes, not the weights): only what runs is run again.
"""

from __future__ import annotations

from tests.support.sharp import SHARP_FACTOR, qk_projections

from .build import NotBuilt, build_subject
from .catalog import Entry
from .ours import run_ours
from .outcome import CRASH, EXACT, MISMATCH, NOT_INSTANTIABLE, Outcome, one_line

__all__ = ["SHARP_FACTOR", "sharp_outcome"]

# The plain column's states that are run again sharp: the others do not depend on the weights.
RERUN = (EXACT, MISMATCH, CRASH)


def sharp_outcome(entry: Entry, plain: Outcome, factor: float = SHARP_FACTOR) -> Outcome:
    """The entry's sharp cell: ours on the entry's model with its query / key projections scaled by `factor`."""
    if plain.state not in RERUN:
        return Outcome(plain.state, plain.reason, "as unscaled")
    try:
        subject = build_subject(entry, sharp=factor)
    except NotBuilt as exc:
        return Outcome(NOT_INSTANTIABLE, one_line(str(exc)))
    scaled = len(qk_projections(subject.model))
    if scaled == 0:  # nothing to sharpen: the plain column already says it all
        return Outcome(plain.state, plain.reason, "no query / key projection found: as unscaled")
    outcome = run_ours(subject)
    outcome.notes = f"{outcome.notes} scaled={scaled}x{factor:g}".strip()
    return outcome
