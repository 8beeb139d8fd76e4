"""What a user receives for one request: `GenerationOutput` (made by `Request.to_output`, requests.py).

An output does not copy its request's growing lists: each output's `generated_tokens`, `logprobs`, ... is a
`SharedPrefix` of the request's own list (which only grows), copied into a list the first time it is read.
`new_tokens` (and `new_logprobs`, `new_top_logprobs`) are the items new since the request's previous output,
so a stream of N tokens read through them costs O(N) in all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Generic, TypeVar, cast, overload

from .status import RequestStatus

T = TypeVar("T")
_NO_DEFAULT: Any = object()


class SharedPrefix(Generic[T]):
    """`head` followed by the first `stop` items of `items`, an append-only list: what one output of a
    request holds instead of a copy of the request's list. The list only grows, so this prefix never
    changes; it is copied only when read (`CopiedOnRead`), and pickles / deep-copies as that copy."""

    __slots__ = ("head", "items", "stop")

    def __init__(self, items: Sequence[T], stop: int | None = None, head: tuple[T, ...] = ()) -> None:
        self.items, self.stop, self.head = items, len(items) if stop is None else stop, head

    def to_list(self) -> list[T]:
        return [*self.head, *self.items[: self.stop]]

    def tail(self, start: int) -> list[T]:
        """Items `start` to `stop` of `items` (`head` not counted): O(stop - start)."""
        return list(self.items[start : self.stop])

    def __reduce__(self) -> tuple[type[list[T]], tuple[list[T]]]:
        return (list, (self.to_list(),))


def shared(items: Sequence[T], stop: int | None = None, head: tuple[T, ...] = ()) -> list[T]:
    """A `SharedPrefix` where a `CopiedOnRead` field expects its list (it is the list once read)."""
    return cast("list[T]", SharedPrefix(items, stop, head))


class CopiedOnRead(Generic[T]):
    """A dataclass field that may hold a `SharedPrefix`, copied into a list (and kept) when first read;
    any other value is stored and read as it is. Installed on `GenerationOutput`'s list fields after the
    class is made, so their declarations (signature, types, defaults) stay plain lists."""

    def __init__(self, name: str, default: T = _NO_DEFAULT) -> None:
        self.name, self.default = name, default

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> T: ...
    @overload
    def __get__(self, obj: object, owner: type | None = None) -> T: ...
    def __get__(self, obj: object | None, owner: type | None = None) -> T:
        if obj is None:  # the class's attribute: the field's default, or none (a required field)
            if self.default is _NO_DEFAULT:
                raise AttributeError(self.name)
            return self.default
        value = obj.__dict__[self.name]
        if isinstance(value, SharedPrefix):
            value = obj.__dict__[self.name] = value.to_list()
        return cast(T, value)

    def __set__(self, obj: object, value: T) -> None:
        obj.__dict__[self.name] = value

    def tail(self, obj: object, start: int) -> list[Any] | None:
        """Items from `start` on of `obj`'s list (None if it has none), without copying the rest."""
        value = obj.__dict__[self.name]
        if value is None:
            return None
        return value.tail(start) if isinstance(value, SharedPrefix) else list(value[start:])


@dataclass
class GenerationOutput:
    """What a user receives for one request (final, or partial when streaming).

    The per-token lists of an output made by `Request.to_output` are shared with the request until first
    read (`SharedPrefix`); `new_tokens` and its siblings give what is new since the request's previous
    output. Every attribute is a field (`dataclasses.replace` / `asdict` keep them all): transformers'
    own first, ours (speculation counts, weight versions) after them, with defaults.
    """

    request_id: str
    prompt_ids: list[int]
    generated_tokens: list[int]
    status: RequestStatus
    logprobs: list[float] | None = None
    error: str | None = None
    finish_reason: str | None = None  # "stop" (eos, stop string, guided end), "length", "cancelled", "error"
    top_logprobs: list[dict[int, float]] | None = None  # per generated token, best first
    prompt_logprobs: list[float | None] | None = None  # per prompt token; the first is None
    prompt_top_logprobs: list[dict[int, float] | None] | None = None  # the same, with top_logprobs > 0
    created_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    timestamps: list[float] | None = None  # one `time.perf_counter()` per generated token (record_timestamps)
    # Ours, after transformers' fields. Speculative decoding's counts: draft tokens verified and how many
    # were accepted (appended as generated tokens), both 0 without speculation (docs/speculative_decoding.md).
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    # Which weights produced the tokens (docs/manager.md, "Weight versions"). `weight_version_runs`:
    # `(index, version)` for each run of generated tokens that one weight version produced, in order (the run
    # goes on to the next one's index); `kv_weight_version`: the version the oldest KV the last token attended
    # to was computed under (below `weight_version_last` when `pause(mode="keep")` carried the request's KV
    # across an update; None before the request ran).
    weight_version_runs: tuple[tuple[int, int], ...] = ()
    kv_weight_version: int | None = None
    # Where `new_tokens` starts in `generated_tokens` (0 for an output built by hand).
    new_from: int = field(default=0, repr=False, compare=False)

    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def new_tokens(self) -> list[int]:
        """The generated tokens new since this request's previous output (all of them in its first or
        only one): the outputs of a streamed request, taken in order, concatenate to its tokens. O(new)."""
        return _COPIED["generated_tokens"].tail(self, self.new_from) or []

    @property
    def new_logprobs(self) -> list[float] | None:
        """`logprobs` of `new_tokens` (None when the request has none)."""
        return _COPIED["logprobs"].tail(self, self.new_from)

    @property
    def new_top_logprobs(self) -> list[dict[int, float]] | None:
        """`top_logprobs` of `new_tokens` (None when the request has none)."""
        return _COPIED["top_logprobs"].tail(self, self.new_from)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / verified draft tokens (0.0 without speculation)."""
        return self.accepted_draft_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def weight_version_first(self) -> int | None:
        """The weight version that produced the first generated token (None before any)."""
        return self.weight_version_runs[0][1] if self.weight_version_runs else None

    @property
    def weight_version_last(self) -> int | None:
        """The weight version that produced the last generated token (None before any)."""
        return self.weight_version_runs[-1][1] if self.weight_version_runs else None

    @property
    def weight_version_changed_at(self) -> int | None:
        """The index in `generated_tokens` of the first token a later weight version produced (None: one
        version produced them all)."""
        return self.weight_version_runs[1][0] if len(self.weight_version_runs) > 1 else None

    def weight_version_of(self, index: int) -> int:
        """The weight version that produced `generated_tokens[index]`."""
        if not 0 <= index < len(self.generated_tokens):
            raise IndexError(f"no generated token {index}")
        return next(version for start, version in reversed(self.weight_version_runs) if start <= index)

    @property
    def tokens_per_step(self) -> float:
        """Generated tokens per step that produced some (1.0 without speculation): each step appends its
        accepted draft tokens and one token of the target's own."""
        produced = len(self.generated_tokens)
        steps = produced - self.accepted_draft_tokens
        return produced / steps if steps > 0 else 0.0

    @property
    def ttft(self) -> float | None:
        """Seconds from submission to the first generated token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.created_time


# The lists an output may share with its request, each behind a `CopiedOnRead` with the field's default.
_SHARED_FIELDS = (
    "prompt_ids",
    "generated_tokens",
    "logprobs",
    "top_logprobs",
    "prompt_logprobs",
    "prompt_top_logprobs",
    "timestamps",
)
_COPIED: dict[str, CopiedOnRead[Any]] = {
    f.name: CopiedOnRead(f.name, _NO_DEFAULT if f.default is MISSING else f.default)
    for f in fields(GenerationOutput)
    if f.name in _SHARED_FIELDS
}
for _name, _descriptor in _COPIED.items():
    setattr(GenerationOutput, _name, _descriptor)
