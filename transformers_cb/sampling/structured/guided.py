"""`GuidedDecoding`: what one request's output must match (a JSON schema, a regex, a choice or a grammar).

Torch-free user input: `add_request(..., guided=...)` and `generate_batch(..., guided=...)` take a
`GuidedDecoding`, a dict with one of its field names (`{"json": schema}`, `{"regex": r"..."}`, ...) or a
pydantic model class (its JSON schema). `sampling/structured/grammars.py` compiles it; docs/structured_outputs.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class GuidedDecoding:
    """Exactly one of the fields is set (vLLM's `GuidedDecodingParams` names).

    json: a JSON schema, as a dict or as JSON text; the output is one JSON value it validates.
    regex: the whole output matches this regular expression (Rust `regex` syntax).
    choice: the output is exactly one of these strings.
    grammar: an EBNF grammar, GBNF (llama.cpp) or Lark syntax; its start rule is `root` (GBNF) or `start` (Lark).
    json_object: True: any JSON object (OpenAI's `response_format={"type": "json_object"}`).
    """

    json: dict[str, object] | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False

    @property
    def kind(self) -> str:
        set_kinds = [name for name in KINDS if _is_set(getattr(self, name))]
        return set_kinds[0]

    def key(self) -> tuple[str, str]:
        """What compiled grammars are cached by: the kind and the constraint in one canonical text."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json":
            text = json.dumps(json.loads(value) if isinstance(value, str) else value, sort_keys=True)
        elif kind == "choice":
            text = json.dumps(list(value))
        elif kind == "json_object":
            text = ""
        else:
            text = value
        return kind, text


def _is_set(value: object) -> bool:
    return value is not None and value is not False


def as_guided(value: object, label: str) -> GuidedDecoding | None:
    """`value` as a checked `GuidedDecoding` (None: unconstrained); `ValueError` naming `label` otherwise."""
    if value is None:
        return None
    if isinstance(value, type) and hasattr(value, "model_json_schema"):  # a pydantic model class
        value = GuidedDecoding(json=value.model_json_schema())
    elif isinstance(value, dict):
        unknown = sorted(set(value) - set(KINDS))
        if unknown:
            raise ValueError(
                f"{label}: guided got unknown key(s) {unknown}; give one of {list(KINDS)} "
                "(a JSON schema goes under 'json': guided={'json': schema})"
            )
        value = GuidedDecoding(**value)
    if not isinstance(value, GuidedDecoding):
        raise ValueError(
            f"{label}: guided must be a GuidedDecoding, a dict with one of {list(KINDS)}, or a pydantic "
            f"model class, got {type(value).__name__}"
        )
    given = [field.name for field in fields(value) if _is_set(getattr(value, field.name))]
    if len(given) != 1:
        raise ValueError(f"{label}: guided needs exactly one of {list(KINDS)}, got {given or 'none'}")
    kind = given[0]
    item = getattr(value, kind)
    if kind == "json":
        if isinstance(item, str):
            try:
                item = json.loads(item)
            except json.JSONDecodeError as error:
                raise ValueError(f"{label}: guided json is not valid JSON text: {error}") from None
        if not isinstance(item, (dict, bool)):
            raise ValueError(
                f"{label}: guided json must be a JSON schema (an object), got {type(item).__name__}"
            )
    elif kind == "choice":
        if isinstance(item, str) or not all(isinstance(c, str) for c in item) or not item:
            raise ValueError(f"{label}: guided choice must be a non-empty list of strings, got {item!r}")
        value = GuidedDecoding(choice=tuple(item))
    elif kind in ("regex", "grammar"):
        if not isinstance(item, str) or not item:
            raise ValueError(f"{label}: guided {kind} must be a non-empty string, got {item!r}")
    elif item is not True:
        raise ValueError(f"{label}: guided json_object must be True, got {item!r}")
    return value
