"""The states a model type ends in, and one row of the matrix."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

EXACT = "exact"  # every run's greedy tokens equal generate()'s, prompt by prompt
REFUSED = "refused"  # a clear error up front naming the model type and what is missing
MISMATCH = "mismatch"  # ran, but some tokens differ from generate() (beyond a floating-point near-tie)
CRASH = "crash"  # any other exception, a failed request, a hang, a dead manager thread or process
NOT_INSTANTIABLE = "not instantiable"  # the tiny config, the model or generate() itself fails offline
STATES = (EXACT, REFUSED, MISMATCH, CRASH, NOT_INSTANTIABLE)
FAILING = (MISMATCH, CRASH)  # what the tool's exit status (and CI) fails on, in either column of ours


@dataclass
class Outcome:
    """What one engine did on one model type."""

    state: str
    reason: str = ""
    notes: str = ""  # e.g. "preemptions=3 prefix_hit_tokens=16 near_ties=1"

    @classmethod
    def from_dict(cls, d: dict) -> Outcome:
        return cls(**d)


@dataclass
class Row:
    """One model type (or image-text-to-text class) of the matrix: ours (plain and sharp) and the built-in's
    outcome."""

    name: str
    model_type: str
    mapping: str
    family: str = ""
    layer_kinds: str = ""
    seconds: float = 0.0
    ours: Outcome = field(default_factory=lambda: Outcome(CRASH, "no result"))
    builtin: Outcome | None = None
    media: Outcome | None = (
        None  # `--media`: the class judged with images (coverage/media.py); None: not asked
    )
    sharp: Outcome | None = None  # ours with query / key scaled (coverage/sharp.py); None: not asked

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Row:
        d = dict(d)
        d["ours"] = Outcome.from_dict(d["ours"])
        d["builtin"] = Outcome.from_dict(d["builtin"]) if d.get("builtin") else None
        d["media"] = Outcome.from_dict(d["media"]) if d.get("media") else None
        d["sharp"] = Outcome.from_dict(d["sharp"]) if d.get("sharp") else None
        return cls(**d)


def one_line(text: str, limit: int = 300) -> str:
    """An error message as one table cell: first lines joined, pipes escaped, cut at `limit`."""
    text = " ".join(part.strip() for part in str(text).strip().splitlines() if part.strip())
    text = text.replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def failing(row: Row) -> list[tuple[str, Outcome]]:
    """(column, outcome) of each of ours' columns (plain, sharp) in a failing state."""
    columns = [("ours", row.ours), ("sharp", row.sharp)]
    return [(name, o) for name, o in columns if o is not None and o.state in FAILING]
