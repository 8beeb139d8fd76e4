"""Counts of speculation's verification steps (torch-free): per request (`SpeculationState.stats`,
back_off.py) and for all of a scheduler's requests (`Scheduler.speculation`), reported by
`manager.stats()` and each request's output."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpeculationStats:
    """Counts of verification steps: drafted / accepted draft tokens, tokens emitted by those steps."""

    steps: int = 0  # steps in which the request ran draft tokens
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0  # tokens appended by those steps (accepted + the target's own token)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens a verification step appended on average (1.0 would be plain decoding)."""
        return self.emitted / self.steps if self.steps else 0.0

    def add(self, drafted: int, accepted: int, emitted: int) -> None:
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        self.emitted += emitted
